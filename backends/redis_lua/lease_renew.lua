-- Set the live hold of a token on a named lease to end at now + ttl (an absolute expiry).
-- KEYS[1] the lease hash; ARGV: the token's epoch and number (see lease_acquire.lua),
-- ttl_ms. Returns the new expiry (ms), or false.
local ep, tok, exp = unpack(redis.call('HMGET', KEYS[1], 'ep', 'tok', 'exp'))
if ep ~= ARGV[1] or tok ~= ARGV[2] or tonumber(exp or '0') <= now then
  return false
end
local expires = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'exp', expires)
return expires
