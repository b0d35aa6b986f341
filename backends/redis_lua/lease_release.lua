-- Free a named lease now if the token holds it live, keeping the token for the next one.
-- KEYS[1] the lease hash; ARGV: the token's epoch and number (see lease_acquire.lua).
-- Returns 1 if released, else 0.
local ep, tok, exp = unpack(redis.call('HMGET', KEYS[1], 'ep', 'tok', 'exp'))
if ep ~= ARGV[1] or tok ~= ARGV[2] or tonumber(exp or '0') <= now then
  return 0
end
redis.call('HSET', KEYS[1], 'exp', 0, 'hold', '')
return 1
