-- Release the holder's run so that a backup claims it at its next check.
-- KEYS[1] run hash, KEYS[2] attempts hash, KEYS[3] done zset
-- ARGV: token, slot. Returns 1 when handed over, else 0. The token is blanked (''), not
-- deleted.
local run, slot = KEYS[1], ARGV[2]
local st, tok, attempt, claimed = unpack(redis.call('HMGET', run, 'st', 'tok', 'att', 'c'))
if st ~= 'running' or tok ~= ARGV[1] then
  return 0
end
local id = slot .. ':' .. attempt
if claimed then
  redis.call('HSET', run, 'st', 'handed_over', 'tok', '', 'exp', now, 'o', 'handed_over',
    'f', now)
  redis.call('ZADD', KEYS[3], now, id)
else  -- a record of store format 1, or none (trimmed)
  redis.call('HSET', run, 'st', 'handed_over', 'tok', '', 'exp', now)
  end_attempt(KEYS[2], KEYS[3], id, 'handed_over', nil)
end
return 1
