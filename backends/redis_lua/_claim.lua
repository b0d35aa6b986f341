-- The claim of one run (the claim algorithm of lease_core.abc), as a function that
-- claim.lua calls once and claim_many.lua once per claim.
-- job hash      {p/job}:job    first_seen, last_slot, seq; sid (marker of the job's
--               data), lost and quiet (after a data loss, see 0.)
-- run hash      {p/job}:run:<slot>  st, att, tok, inst, exp, cp, n, tk (tk: takeovers,
--               the attempts max_attempts counts besides the first; absent on runs
--               written before it was kept)
-- open zset     {p/job}:open   slots of running / handed_over runs
-- history zset  {p/job}:hist   attempt id -> insertion sequence
-- attempts hash {p/job}:att    attempt id -> JSON record
-- done zset     {p/job}:done   finished attempt id -> finish time
-- slot, inst, token: the run's slot (text), the claiming instance, the claim's token;
-- lease_ms, max_attempts (nil = none): numbers; reason: text; overlap_skip: boolean;
-- run_prefix: {p/job}:run:; seen: the marker the caller saw ('' = none yet);
-- longest: the longest lease the caller knows (ms).
-- Returns 'status|now|attempt|reason|expires|run_status|marker|instance' ('' = none):
-- one string, which a client reads at a fraction of the cost of an array of eight.
local function reply(...)
  local parts = {...}
  for k, v in ipairs(parts) do
    if type(v) == 'number' then
      parts[k] = string.format('%d', v)
    end
  end
  return table.concat(parts, '|')
end

local function claim(job, run, open, hist, att, done, slot, inst, token, lease_ms, reason,
                     overlap_skip, max_attempts, run_prefix, seen, longest)
  local slot_n = tonumber(slot)

  -- 0. Data loss (a restart without persistence, a failover to a lagging replica): the
  -- job's marker 'sid' is missing or differs from the one the caller saw. Holders of
  -- leases lost with the data may still be running, so no attempt starts before the loss
  -- plus the longest lease the callers know ('quiet'; a later caller with a longer lease
  -- extends it, never shortens it). `seen` is the marker the caller saw ('' = none
  -- yet), `longest` the longest lease it knows (ms).
  local sid, lost, quiet = unpack(redis.call('HMGET', job, 'sid', 'lost', 'quiet'))
  quiet = tonumber(quiet)
  if seen ~= '' and sid ~= seen then
    if not sid then
      sid = redis.sha1hex(token)  -- new and unique, and does not reveal the token
      redis.call('HSET', job, 'sid', sid)
    end
    if not lost then
      lost = now
      redis.call('HSET', job, 'lost', lost)
    end
    if not quiet or quiet < tonumber(lost) + longest then
      quiet = tonumber(lost) + longest
      redis.call('HSET', job, 'quiet', quiet)
    end
  end
  if quiet and quiet > now then
    return reply('running', now, 0, '', quiet, '', sid, '')  -- no run: claim again after quiet
  end
  if not sid then  -- the job's first claim in this store
    sid = redis.sha1hex(token)
    redis.call('HSET', job, 'sid', sid)
  end

  local function record(attempt, why, outcome, err)
    local id = slot .. ':' .. attempt
    local seq = redis.call('HINCRBY', job, 'seq', 1)
    local rec = {s = slot, a = attempt, i = inst, r = why, c = now}
    if outcome then
      rec.o = outcome
      rec.e = err
      rec.f = now
      redis.call('ZADD', done, now, id)
    end
    redis.call('ZADD', hist, seq, id)
    redis.call('HSET', att, id, cjson.encode(rec))
    redis.call('HINCRBY', run, 'n', 1)
  end

  -- 1. register the job and raise its last slot
  local first, last = unpack(redis.call('HMGET', job, 'first_seen', 'last_slot'))
  local raise = not last or tonumber(last) < slot_n
  if not first and raise then
    redis.call('HSET', job, 'first_seen', now, 'last_slot', slot)
  elseif not first then
    redis.call('HSET', job, 'first_seen', now)
  elseif raise then
    redis.call('HSET', job, 'last_slot', slot)
  end

  local st, attempt, exp, holder, tok = unpack(redis.call('HMGET', run, 'st', 'att', 'exp', 'inst',
    'tok'))

  -- the reply, from the run as it is now (read back), or as the caller knows it to be
  local function result(status, why, s, a, e, i)
    if not s then
      s, a, e, i = unpack(redis.call('HMGET', run, 'st', 'att', 'exp', 'inst'))
    end
    return reply(status, now, a or 0, why or '', e or '', s or '', sid, i or '')
  end

  -- 2. a new run: skipped behind a live earlier run, or won
  if not st then
    if overlap_skip then
      for _, other in ipairs(redis.call('ZRANGEBYSCORE', open, '-inf', '(' .. slot)) do
        local ost, oexp = unpack(redis.call('HMGET', run_prefix .. other, 'st', 'exp'))
        if ost == 'running' and oexp and tonumber(oexp) > now then
          redis.call('HSET', run, 'st', 'skipped', 'att', 1, 'inst', inst)
          record(1, reason, 'skipped', 'an earlier run of the job still holds its lease')
          return result('skipped')
        end
      end
    end
    redis.call('HSET', run, 'st', 'running', 'att', 1, 'tok', token, 'inst', inst,
      'exp', now + lease_ms, 'tk', 0)
    redis.call('ZADD', open, slot, slot)
    record(1, reason)
    return result('won', reason, 'running', 1, now + lease_ms, inst)
  end

  -- A claim sent again with the token that holds the run (its first try took effect and
  -- the reply was lost with the connection) answers as the first try did.
  if st == 'running' and tok == token then
    local rec = redis.call('HGET', att, slot .. ':' .. attempt)
    return result('won', rec and cjson.decode(rec).r or reason, st, attempt, exp, holder)
  end

  -- 3. finished; 4. live lease held by another attempt
  if FINISHED[st] then
    return result('finished', nil, st, attempt, exp, holder)
  end
  attempt = tonumber(attempt)
  if st == 'running' and exp and tonumber(exp) > now then
    return result('running', nil, st, attempt, exp, holder)
  end

  -- 5. handed over; 6. expired (escalate when the first attempt and the takeovers reach
  -- max_attempts, hand-overs not counted; else take over)
  local why
  local last_id = slot .. ':' .. attempt
  local takeovers = tonumber(redis.call('HGET', run, 'tk') or '')
  if not takeovers then
    -- a run written before 'tk' was kept: count the takeovers its history recorded
    takeovers = 0
    for a = 2, attempt do
      local raw = redis.call('HGET', att, slot .. ':' .. a)
      if raw and cjson.decode(raw).r == 'takeover' then
        takeovers = takeovers + 1
      end
    end
  end
  if st == 'handed_over' then
    why = 'hand-over'
  else
    if max_attempts and 1 + takeovers >= max_attempts then
      redis.call('HSET', run, 'tk', takeovers)
      end_attempt(att, done, last_id, 'escalated', 'lease lost on attempt ' .. attempt
        .. ' of max_attempts=' .. max_attempts .. ' (hand-overs not counted); escalated')
      redis.call('HSET', run, 'st', 'escalated')
      redis.call('HDEL', run, 'tok', 'exp')
      redis.call('ZREM', open, slot)
      return result('escalated', nil, 'escalated', attempt, nil, holder)
    end
    end_attempt(att, done, last_id, 'lost', 'lease expired without renewal')
    why = 'takeover'
    takeovers = takeovers + 1
  end
  redis.call('HSET', run, 'st', 'running', 'att', attempt + 1, 'tok', token, 'inst', inst,
    'exp', now + lease_ms, 'tk', takeovers)
  redis.call('ZADD', open, slot, slot)
  record(attempt + 1, why)
  return result('won', why, 'running', attempt + 1, now + lease_ms, inst)
end
