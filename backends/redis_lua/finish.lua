-- End the holder's attempt with an outcome; the run takes the outcome as its status.
-- KEYS[1] run hash, KEYS[2] open zset, KEYS[3] attempts hash, KEYS[4] done zset
-- ARGV: token, slot, outcome[, error] (no fourth argument: no error).
-- Returns 1 when done, else 0. Four commands besides TIME: HMGET and HSET of the run (the
-- record of its current attempt is in it, see _prelude.lua), ZREM open, ZADD done. An
-- ended run's token and expiry are blanked ('') in the same HSET, not deleted.
local run, slot, outcome, err = KEYS[1], ARGV[2], ARGV[3], ARGV[4]
local st, tok, attempt, claimed = unpack(redis.call('HMGET', run, 'st', 'tok', 'att', 'c'))
if st ~= 'running' or tok ~= ARGV[1] then
  return 0
end
local id = slot .. ':' .. attempt
if claimed then
  if err then
    redis.call('HSET', run, 'st', outcome, 'tok', '', 'exp', '', 'o', outcome, 'f', now,
      'e', err)
  else
    redis.call('HSET', run, 'st', outcome, 'tok', '', 'exp', '', 'o', outcome, 'f', now)
  end
  redis.call('ZADD', KEYS[4], now, id)
else  -- a record of store format 1, or none (trimmed)
  redis.call('HSET', run, 'st', outcome, 'tok', '', 'exp', '')
  end_attempt(KEYS[3], KEYS[4], id, outcome, err)
end
redis.call('ZREM', KEYS[2], slot)
return 1
