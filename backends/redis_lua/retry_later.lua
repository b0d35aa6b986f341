-- Retries within a run (issue 19, part 1): end the holder's failed attempt as finish.lua
-- does; while the run had fewer retries ('rt', counted by the claims that made them)
-- than there are delays, the run stays open, 'retrying' until now + the next delay, with
-- no token. KEYS[1] run hash, KEYS[2] open zset, KEYS[3] attempts hash, KEYS[4] done zset
-- ARGV: token, slot, outcome, error ('' for none, else 'E' and its text, as finish_many
-- sends it: an error None is recorded as none, not as ''), then one delay (ms) per retry
-- allowed.
-- Returns the retry's number (0: the run ended with the outcome); -1 when the token no
-- longer holds the run (nothing changed).
local run, slot, outcome = KEYS[1], ARGV[2], ARGV[3]
local err = ARGV[4] ~= '' and string.sub(ARGV[4], 2) or nil
local st, tok, attempt, claimed, rt = unpack(redis.call('HMGET', run, 'st', 'tok', 'att', 'c',
  'rt'))
if st ~= 'running' or tok ~= ARGV[1] then
  return -1
end
rt = tonumber(rt or '') or 0
local retry = rt < #ARGV - 4
local status = retry and 'retrying' or outcome
local exp = retry and (now + tonumber(ARGV[5 + rt])) or ''
local id = slot .. ':' .. attempt
if claimed then
  redis.call('HSET', run, 'st', status, 'tok', '', 'exp', exp, 'o', outcome, 'f', now)
  if err then
    redis.call('HSET', run, 'e', err)
  end
  redis.call('ZADD', KEYS[4], now, id)
else  -- a record of store format 1, or none (trimmed)
  redis.call('HSET', run, 'st', status, 'tok', '', 'exp', exp)
  end_attempt(KEYS[3], KEYS[4], id, outcome, err)
end
if retry then
  return rt + 1
end
redis.call('ZREM', KEYS[2], slot)
return 0
