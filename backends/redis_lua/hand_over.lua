-- Release the holder's run so that a backup claims it at its next check.
-- KEYS[1] run hash, KEYS[2] attempts hash, KEYS[3] done zset
-- ARGV: token, slot. Returns 1 when handed over, else 0.
local st, tok, attempt = unpack(redis.call('HMGET', KEYS[1], 'st', 'tok', 'att'))
if st ~= 'running' or tok ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'st', 'handed_over', 'exp', now)
redis.call('HDEL', KEYS[1], 'tok')
end_attempt(KEYS[2], KEYS[3], ARGV[2] .. ':' .. attempt, 'handed_over', nil)
return 1
