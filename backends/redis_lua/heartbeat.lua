-- Renew leases, each to an absolute expiry, now + lease_ms on the server's clock. Only
-- the current token of a running run whose lease is still live may renew: an expired
-- lease is never revived.
-- KEYS: run hashes (on a Cluster, of one job, so in one slot; otherwise of any jobs);
-- ARGV: token, lease_ms for each key, in order.
-- Returns {now, flags, graces}: flags holds one character per key, '1' if renewed, 'c'
-- if an operator cancelled the run (cancel(grace=), operate.lua: the token stays, 'exp'
-- is the cancel's time 'g' plus the grace), else '0'; graces the grace (ms) of each 'c'.
local flags, graces = {}, {}
for i, key in ipairs(KEYS) do
  local token, lease_ms = ARGV[2 * i - 1], ARGV[2 * i]
  local st, tok, exp, g = unpack(redis.call('HMGET', key, 'st', 'tok', 'exp', 'g'))
  if st == 'cancelled' and tok == token then
    flags[i] = 'c'
    graces[#graces + 1] = math.max((tonumber(exp) or now) - (tonumber(g) or now), 0)
  elseif st ~= 'running' or tok ~= token or not exp or tonumber(exp) <= now then
    flags[i] = '0'
  else
    redis.call('HSET', key, 'exp', now + tonumber(lease_ms), 'hb', now)  -- hb: heartbeat_at
    flags[i] = '1'
  end
end
return {now, table.concat(flags), graces}
