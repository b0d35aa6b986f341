-- Set the live hold of a token on a named lease to end at now + ttl (an absolute expiry).
-- KEYS[1] the lease hash; ARGV: token, ttl_ms. Returns the new expiry (ms), or false.
local tok, exp = unpack(redis.call('HMGET', KEYS[1], 'tok', 'exp'))
if tok ~= ARGV[1] or tonumber(exp or '0') <= now then
  return false
end
local expires = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'exp', expires)
return expires
