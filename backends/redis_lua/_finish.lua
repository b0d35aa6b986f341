-- The finish of one attempt, as a function that finish.lua calls once and finish_many.lua
-- once per finish: the holder's attempt ends with an outcome, which the run takes as its
-- status.
-- run: run hash, open: open zset, att: attempts hash, done: done zset; token, slot (text),
-- outcome; err: the error text, or nil for none.
-- Returns 1 when done, else 0. Four commands besides TIME: HMGET and HSET of the run (the
-- record of its current attempt is in it, see _prelude.lua), ZREM open, ZADD done. An
-- ended run's token and expiry are blanked ('') in the same HSET, not deleted.
local function finish(run, open, att, done, token, slot, outcome, err)
  local st, tok, attempt, claimed = unpack(redis.call('HMGET', run, 'st', 'tok', 'att', 'c'))
  if st ~= 'running' or tok ~= token then
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
    redis.call('ZADD', done, now, id)
  else  -- a record of store format 1, or none (trimmed)
    redis.call('HSET', run, 'st', outcome, 'tok', '', 'exp', '')
    end_attempt(att, done, id, outcome, err)
  end
  redis.call('ZREM', open, slot)
  return 1
end
