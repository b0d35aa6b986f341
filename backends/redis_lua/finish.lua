-- End the holder's attempt with an outcome; the run takes the outcome as its status.
-- KEYS[1] run hash, KEYS[2] attempts hash, KEYS[3] done zset
-- ARGV: token, slot, outcome[, error] (no fourth argument: no error).
-- Returns 1 when done, else 0. Three commands besides TIME: HMGET and HSET of the run (the
-- record of its current attempt is in it, see _prelude.lua), ZADD done. An ended run's
-- token and expiry are blanked ('') in the same HSET, not deleted; the run stays in its
-- job's list of open runs (ol) until the job's next claim finds it ended.
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
  redis.call('ZADD', KEYS[3], now, id)
else  -- a record of store format 1, or none (trimmed)
  redis.call('HSET', run, 'st', outcome, 'tok', '', 'exp', '')
  end_attempt(KEYS[2], KEYS[3], id, outcome, err)
end
return 1
