-- Operations (lease_core/operations.py) on one job's keys, atomically: trigger, pause,
-- resume, retry and cancel, or a refusal that changes nothing.
-- KEYS[1] job hash, KEYS[2] open zset, KEYS[3] attempts hash (store format 1),
-- KEYS[4] done zset; ARGV: kind, slot ('' for a job operation), by, run key prefix
-- ({p/job}:run:; the run of a trigger is made at a slot found here, in the job's slot),
-- a cancel's grace in ms.
-- KEYS[5] the operation's own key ({p/job}:op:<random id>): it keeps the answer of an
-- operation made for 10 minutes, and a call sent again with the same key (a resend after a failed connection,
-- by this library or by the driver) answers it again and changes nothing.
-- Returns 'refused|slot|status' ('' = none): refused is unknown_job, no_run or conflict
-- (a pause of a paused job, a resume of one not paused, a run whose status forbids it).
-- - trigger: a run at the store's now (the next free millisecond), handed_over with
--   attempt 0, whose first claim is attempt 1 with reason 'manual' (q) and 'b' = by (qb);
-- - retry: a failed, timed_out or escalated run is handed_over again, next reason retry;
-- - cancel: a running, handed-over or retrying run ends 'cancelled' (its open attempt too, error
--   'cancelled by <by>'; a run nobody holds gets an attempt of its own, instance <by>, in
--   the history zset KEYS[6], so the cancel is in its history); claims then find it
--   finished. cancel(grace=): the run keeps
--   its holder's token, 'g' the cancel's time and 'exp' g + the grace, so the holder's
--   heartbeat answers "cancelled" with the grace (heartbeat.lua);
-- - pause / resume: the job hash's 'paused' (who), read by every claim (_claim.lua), and
--   'paused_at' (since when); a resume appends '; resumed by <by>' to the error of
--   each slot the pause skipped (found in the done zset since 'paused_at') and raises
--   the job's 'last_slot' to now (where a starting scheduler catches up from).
local job, open, att, done, op, hist = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local kind, slot, by, prefix = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local answered = redis.call('GET', op)
if answered then
  return answered
end
local function operate()
  if redis.call('EXISTS', job) == 0 then
    return 'unknown_job||'
  end
  if kind == 'pause' then
    -- A pause of a paused job is refused: it would hide who paused it.
    if redis.call('HSETNX', job, 'paused', by) == 0 then
      return 'conflict||'
    end
    redis.call('HSET', job, 'paused_at', now)
    return '||'
  elseif kind == 'resume' then
    -- A resume leaves a record: each slot the pause skipped gets '; resumed by <by>'.
    local was, since, last = unpack(redis.call('HMGET', job, 'paused', 'paused_at',
      'last_slot'))
    if not was then
      return 'conflict||'  -- not paused
    end
    -- The slots due while paused are never caught up, even those no instance was up to
    -- skip: a starting scheduler catches up from the job's last slot.
    if not last or tonumber(last) < now then
      redis.call('HSET', job, 'last_slot', now)
    end
    if since then
      local mark = 'job paused by ' .. was
      for _, id in ipairs(redis.call('ZRANGEBYSCORE', done, since, '+inf')) do
        local s, a = string.match(id, '^(-?%d+):(%d+)$')
        if a == '1' then
          local o, e = unpack(redis.call('HMGET', prefix .. s, 'o', 'e'))
          if o == 'skipped' and e == mark then
            redis.call('HSET', prefix .. s, 'e', mark .. '; resumed by ' .. by)
          end
        end
      end
    end
    redis.call('HDEL', job, 'paused', 'paused_at')
    return '||'
  elseif kind == 'trigger' then
    local at = now  -- off the whole second, where schedules put their slots
    if at % 1000 == 0 then
      at = at + 1
    end
    while redis.call('EXISTS', prefix .. at) == 1 do
      at = at + 1
    end
    local s = string.format('%d', at)
    redis.call('HSET', prefix .. s, 'st', 'handed_over', 'att', 0, 'inst', by, 'exp', now,
      'tk', 0, 'n', 0, 'q', 'manual', 'qb', by)
    redis.call('ZADD', open, at, s)
    -- The job's last_slot stays: it is where a starting scheduler catches up from, and a
    -- triggered run is no slot of the schedule (its claim raises it).
    return '|' .. s .. '|'
  end
  local run = prefix .. slot
  local st, attempt, c, o = unpack(redis.call('HMGET', run, 'st', 'att', 'c', 'o'))
  if not st then
    return 'no_run|' .. slot .. '|'
  end
  if kind == 'retry' then
    if st ~= 'failed' and st ~= 'timed_out' and st ~= 'escalated' then
      return 'conflict|' .. slot .. '|' .. st
    end
    -- The retried run starts anew: max_attempts counts its takeovers from now ('tk'),
    -- and its job's retry= grants its retries again ('rt').
    redis.call('HSET', run, 'st', 'handed_over', 'tok', '', 'exp', now, 'q', 'retry',
      'qb', by, 'tk', 0)
    redis.call('HDEL', run, 'rt')
    redis.call('ZADD', open, tonumber(slot), slot)
    return '|' .. slot .. '|' .. st
  end
  if st ~= 'running' and st ~= 'handed_over' and st ~= 'retrying' then
    return 'conflict|' .. slot .. '|' .. st
  end
  local err = 'cancelled by ' .. by
  if st ~= 'running' then
    -- Nobody holds the run: the cancel is recorded as the attempt it prevents (who
    -- cancelled it, and the reason and requester its claim would have had), with the
    -- job's next history sequence, as a claim records one (_claim.lua).
    local inst, r, e, f, b, q, qb, n = unpack(redis.call('HMGET', run, 'inst', 'r', 'e',
      'f', 'b', 'q', 'qb', 'n'))
    local next_attempt = tonumber(attempt) + 1
    -- 'n' counts the run's attempts in the history: trimming deletes a finished run
    -- whose count falls to 0 (_trim.lua).
    local fields = {'att', next_attempt, 'inst', by, 'c', now, 'o', 'cancelled', 'e', err,
      'f', now, 'r', st == 'retrying' and 'retry' or (q or 'hand-over'),
      'n', (tonumber(n) or 0) + 1}
    if c then  -- the ended attempt's record is kept as JSON, as a claim keeps it
      fields[#fields + 1] = 'h' .. attempt
      fields[#fields + 1] = record_json(slot, attempt, inst, r, c, o, e, f, b)
    end
    redis.call('HDEL', run, 'b')
    if q and qb then
      fields[#fields + 1] = 'b'
      fields[#fields + 1] = qb
    end
    redis.call('HSET', run, unpack(fields))
    local id = slot .. ':' .. next_attempt
    redis.call('ZADD', done, now, id)
    redis.call('ZADD', hist, redis.call('HINCRBY', job, 'seq', 1), id)
  elseif c then
    if not o then
      redis.call('HSET', run, 'o', 'cancelled', 'e', err, 'f', now)
      redis.call('ZADD', done, now, slot .. ':' .. attempt)
    end
  elseif tonumber(attempt) > 0 then
    end_attempt(att, done, slot .. ':' .. attempt, 'cancelled', err)
  end
  -- cancel(grace=): the token stays; 'g' is the cancel's time, 'exp' g + the holder's grace.
  redis.call('HSET', run, 'st', 'cancelled', 'exp', now + math.max(tonumber(ARGV[5]) or 0, 0),
    'g', now)
  redis.call('HDEL', run, 'q', 'qb')
  redis.call('ZREM', open, slot)
  return '|' .. slot .. '|' .. st
end
local answer = operate()
if string.sub(answer, 1, 1) == '|' then  -- made (a refusal changed nothing: not kept)
  redis.call('SET', op, answer, 'PX', 600000)
end
return answer
