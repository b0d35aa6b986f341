-- Renew the leases of one job, each to an absolute expiry, now + lease_ms on the server's
-- clock. Only the current token of a running run whose lease is still live may renew:
-- an expired lease is never revived.
-- KEYS: run hashes (of one job); ARGV: token, lease_ms for each key, in order.
-- Returns {now, 1 if the first was renewed else 0, ... one flag per key}.
local out = {now}
for i, key in ipairs(KEYS) do
  local token, lease_ms = ARGV[2 * i - 1], ARGV[2 * i]
  local st, tok, exp = unpack(redis.call('HMGET', key, 'st', 'tok', 'exp'))
  if st ~= 'running' or tok ~= token or not exp or tonumber(exp) <= now then
    out[i + 1] = 0
  else
    redis.call('HSET', key, 'exp', now + tonumber(lease_ms))
    out[i + 1] = 1
  end
end
return out
