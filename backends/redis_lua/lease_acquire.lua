-- Take a named lease when it is free (lease_core.Lease; see lease_core/_named_leases.py).
-- KEYS[1] the lease hash ({P/lease/E}): tok token, exp expiry (ms, server clock), hold
-- holder ('' once released). It is never deleted, so tokens keep growing; a name new to
-- the server (or after the server lost its data) starts at now, the server's clock in
-- ms, which is larger than any token the name had before.
-- ARGV: holder, ttl_ms. Returns {token, expires} when the caller holds the name (its
-- holder is ARGV[1] and now is expires - ttl: a short reply, the hot path), else {token,
-- expires, now, holder} of the current hold.
local tok, exp, hold = unpack(redis.call('HMGET', KEYS[1], 'tok', 'exp', 'hold'))
local token, expires = tonumber(tok or '0'), tonumber(exp or '0')
if expires > now and hold ~= ARGV[1] then
  return {token, expires, now, hold or ''}
end
if not tok then
  token = now
elseif expires <= now then
  token = token + 1
end
expires = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'tok', token, 'exp', expires, 'hold', ARGV[1])
return {token, expires}
