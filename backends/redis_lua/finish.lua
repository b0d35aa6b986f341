-- End the holder's attempt with an outcome; the run takes the outcome as its status.
-- KEYS[1] run hash, KEYS[2] open zset, KEYS[3] attempts hash, KEYS[4] done zset
-- ARGV: token, slot, outcome, has_error (1/0), error. Returns 1 when done, else 0.
local st, tok, attempt = unpack(redis.call('HMGET', KEYS[1], 'st', 'tok', 'att'))
if st ~= 'running' or tok ~= ARGV[1] then
  return 0
end
local err = nil
if ARGV[4] == '1' then
  err = ARGV[5]
end
redis.call('HSET', KEYS[1], 'st', ARGV[3])
redis.call('HDEL', KEYS[1], 'tok', 'exp')
redis.call('ZREM', KEYS[2], ARGV[2])
end_attempt(KEYS[3], KEYS[4], ARGV[2] .. ':' .. attempt, ARGV[3], err)
return 1
