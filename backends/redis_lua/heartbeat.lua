-- Renew one lease to an absolute expiry, now + lease_ms on the server's clock.
-- Only the current token of a running run whose lease is still live may renew:
-- an expired lease is never revived.
-- KEYS[1] run hash; ARGV: token, lease_ms. Returns {now, 1 if renewed else 0}.
local st, tok, exp = unpack(redis.call('HMGET', KEYS[1], 'st', 'tok', 'exp'))
if st ~= 'running' or tok ~= ARGV[1] or not exp or tonumber(exp) <= now then
  return {now, 0}
end
redis.call('HSET', KEYS[1], 'exp', now + tonumber(ARGV[2]))
return {now, 1}
