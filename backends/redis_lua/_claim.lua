-- The claim of one run (the claim algorithm of lease_core.abc), as a function that
-- claim.lua calls once and claim_many.lua once per claim.
-- job hash      {p/job}:job    first_seen, last_slot, seq; sid (marker of the job's
--               data), lost and quiet (after a data loss, see 0.); trim (the newest
--               slot whose run trimming deleted, see 2.)
-- run hash      {p/job}:run:<slot>  st, att, tok, inst, exp, cp, n, tk (tk: takeovers,
--               the attempts max_attempts counts besides the first; absent on runs
--               written before it was kept); the attempts' records (see _prelude.lua)
-- open zset     {p/job}:open   slots of running / handed_over / retrying runs
--               (rt in the run hash: the retries made, see retry_later.lua)
-- history zset  {p/job}:hist   attempt id -> insertion sequence
-- attempts hash {p/job}:att    attempt id -> JSON record (store format 1 only)
-- done zset     {p/job}:done   finished attempt id -> finish time
-- slot, inst, token: the run's slot (text), the claiming instance, the claim's token;
-- lease_ms, max_attempts (nil = none): numbers; reason: text; overlap_skip: boolean;
-- run_prefix: {p/job}:run:; seen: the marker the caller saw ('' = none yet);
-- longest: the longest lease the caller knows (ms).
-- Returns 'status|now|attempt|reason|expires|run_status|marker|epoch|seq|instance' ('' =
-- none; epoch: see reply()): one string, which a client reads at a fraction of the
-- cost of an array of ten.
-- A first win costs 8 commands: TIME, HMGET job, HMGET run, ZRANGEBYSCORE open (with
-- overlap_skip), HSET run, ZADD open, HSET job, ZADD hist.
local function num(v)
  if type(v) == 'number' then
    return string.format('%d', v)
  end
  return v or ''
end

-- Fences (issue 21): `epoch` is the job's epoch (the store's clock, ms): the later of
-- 'lost' (when a loss of its data was found) and 'ep' (when its data was found on
-- another server, see server_moved); 0 = never. It is sent with every reply so that
-- each attempt numbered after it carries it (lease_core.fence_of).
-- `seq` is the job's history sequence after the claim, which the caller remembers: a
-- store whose sequence is below one a caller saw lost writes (see 0.).
local function reply(status, attempt, why, expires, run_status, sid, instance, epoch, seq)
  return status .. '|' .. string.format('%d', now) .. '|' .. num(attempt or 0) .. '|'
    .. (why or '') .. '|' .. num(expires) .. '|' .. (run_status or '') .. '|'
    .. (sid or '') .. '|' .. num(epoch) .. '|' .. num(seq) .. '|' .. (instance or '')
end

-- Write the job's fields gathered by the claim (jf: field, value, ...), if any.
local function write_job(job, jf)
  if #jf > 0 then
    redis.call('HSET', job, unpack(jf))
  end
end

-- Add attempt `id` to the history, its sequence number written with the job's fields;
-- returns the new sequence number.
local function add_history(job, hist, jf, seq, id)
  seq = (tonumber(seq) or 0) + 1
  jf[#jf + 1] = 'seq'
  jf[#jf + 1] = seq
  redis.call('HSET', job, unpack(jf))
  redis.call('ZADD', hist, seq, id)
  return seq
end

-- Fences (issue 21): a win's check of the server. The job hash keeps 'rid', the
-- server's replication id at the job's last win: a promoted replica takes a new one (and
-- so may a restarted server), so a different id means the job's data changed servers
-- and may have lost writes that no marker can show (the newest claims or renewals of a
-- job whose keys survived). The job then starts a new epoch, 'ep' = now: every attempt
-- won from now on is fenced above every attempt won before. 'rid' is written with the
-- job's first epoch (its registration or first claim in the store, see register.lua and
-- 1.), and only ever with an epoch started in the same call: a job with an epoch and no
-- 'rid' lost the win that would have recorded it (its registration replicated, its first
-- win not: the promoted server has the job without the id, and a caller that never saw
-- that win finds no loss of history), or was written before 'rid' was kept (or by a
-- release that did not write it with the epoch); it is taken as moved, a new epoch and
-- on a promoted server the quarantine. INFO is read before wins only.
-- Quarantine on a promoted server (issue 21, sentinelfix): the holder of a lease the
-- failover lost (its claim, or the renewals that kept it live) still runs until its next
-- heartbeat, so the win that finds the new id on a server that was promoted (it has a
-- 'master_replid2': it took over another server's history, so it may have missed its
-- newest writes) does not take effect: like a found loss (see 0.), no attempt starts
-- before now + the longest lease known ('quiet'; this claim's own lease when the caller
-- knows none), when every such lease has expired. A plain restart (no replid2) keeps
-- what it persisted: a new epoch only, as PostgreSQL quarantines at a promotion only.
-- Returns the end of that quarantine (nil: no change of server, the claim may win) and
-- the job's epoch; the job's fields gathered so far (jf) are written with it.
-- rid: the stored id; epoch: the job's epoch so far; lease_ms, longest: ms.
-- The two ids are cut out with plain finds (the line's value runs to its CR), which cost
-- the server less than the patterns did; a server that prints neither gives '' as before.
local function info_value(info, name)
  local at = string.find(info, name, 1, true)
  if not at then
    return ''
  end
  local stop = string.find(info, '\r', at, true) or (#info + 1)
  return string.sub(info, at + #name, stop - 1)
end

-- (read once per script: a script runs whole, so the server's role cannot change in it;
-- claim_many.lua's claims and a new job's first claim, which records the id with its
-- epoch before its win, share the one INFO)
local server_id_read, server_is_promoted
local function server_id()
  if not server_id_read then
    local info = redis.call('INFO', 'replication')
    server_id_read = info_value(info, '\nmaster_replid:')
    local before = info_value(info, '\nmaster_replid2:')
    server_is_promoted = string.find(before, '[1-9a-f]') ~= nil  -- (a non-zero replid2)
  end
  return server_id_read, server_is_promoted
end

local function server_moved(job, jf, rid, epoch, lease_ms, longest)
  local id, promoted = server_id()
  if id == rid then
    return nil, epoch
  end
  jf[#jf + 1] = 'rid'
  jf[#jf + 1] = id
  epoch = math.max(epoch, now)
  jf[#jf + 1] = 'ep'
  jf[#jf + 1] = epoch
  if not promoted then
    return nil, epoch
  end
  local quiet = now + math.max(longest or 0, lease_ms)
  jf[#jf + 1] = 'quiet'
  jf[#jf + 1] = quiet
  write_job(job, jf)
  return quiet, epoch
end

local function claim(job, run, open, hist, att, done, slot, inst, token, lease_ms, reason,
                     overlap_skip, max_attempts, run_prefix, seen, longest, seen_seq,
                     scheduled)
  local slot_n = tonumber(slot)

  -- 0. Data loss (a restart without persistence, a failover to a lagging replica): the
  -- job's marker 'sid' is missing or differs from the one the caller saw. Holders of
  -- leases lost with the data may still be running, so no attempt starts before the loss
  -- plus the longest lease the callers know ('quiet'; a later caller with a longer lease
  -- extends it, never shortens it). `seen` is the marker the caller saw ('' = none
  -- yet), `longest` the longest lease it knows (ms). The same HMGET reads the job's
  -- registration, watermark and history sequence.
  local sid, lost, quiet, first, last, seq, paused, rid, ep, trimmed = unpack(redis.call(
    'HMGET', job, 'sid', 'lost', 'quiet', 'first_seen', 'last_slot', 'seq', 'paused', 'rid',
    'ep', 'trim'))
  quiet = tonumber(quiet)
  -- Fences (issue 21): a job whose keys survived with its marker can still have lost its
  -- newest writes (a replica promoted a little behind, or while the old primary still
  -- took writes). The caller's `seen_seq` is the highest history sequence it saw: a store
  -- below it lost them. That is a new loss: a new marker (so that every other caller
  -- finds it changed), 'lost' now (the epoch of the attempts numbered from now on), the
  -- quarantine, and the sequence raised to the caller's (so that the callers that saw
  -- no more than it do not find the same loss again).
  if seen ~= '' and sid == seen and (seen_seq or 0) > (tonumber(seq) or 0) then
    sid = redis.sha1hex(token)
    lost = now
    seq = seen_seq
    if not quiet or quiet < lost + longest then
      quiet = lost + longest
    end
    redis.call('HSET', job, 'sid', sid, 'lost', lost, 'quiet', quiet, 'seq', seq)
  end
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
  -- (sentinelfix) a quarantine found here covers the server's change too: its id is
  -- recorded, so that the win after it is not held back a second time. The id is
  -- recorded with a new epoch ('ep' = now), never alone: the quarantine may be one
  -- found earlier (its 'lost' replicated from the server before, or raised by a caller
  -- with a longer lease), whose epoch the attempts the failover lost carry already.
  if seen ~= '' and sid ~= seen and quiet and quiet > now then
    local id = server_id()  -- (its first value: the id)
    if id ~= rid then
      rid = id
      ep = math.max(tonumber(ep) or 0, now)
      redis.call('HSET', job, 'rid', rid, 'ep', ep)
    end
  end
  local epoch = math.max(tonumber(lost) or 0, tonumber(ep) or 0)
  if quiet and quiet > now then
    return reply('running', 0, '', quiet, '', sid, '', epoch, seq)  -- no run: claim again after quiet
  end

  -- 1. the job's fields to write, in one HSET whatever the answer: its marker (the
  -- job's first claim in this store), its registration, its last slot raised
  local jf = {}
  if not sid then
    sid = redis.sha1hex(token)
    jf = {'sid', sid}
    -- Fences: a job first claimed in this store is new, or lost every key with no
    -- caller left that saw them (a restart without persistence of the server and the
    -- whole fleet); nothing tells the two apart, so it starts a new epoch, now, above
    -- every fence it had before (as a named lease new to the server does). A job that
    -- another caller saw lost was given one above ('lost').
    -- The server's id is recorded with the epoch (see server_moved).
    if not ep then
      epoch = math.max(epoch, now)
      rid = server_id()  -- (its first value: the id)
      jf[#jf + 1] = 'ep'
      jf[#jf + 1] = epoch
      jf[#jf + 1] = 'rid'
      jf[#jf + 1] = rid
    end
  end
  if not first then
    jf[#jf + 1] = 'first_seen'
    jf[#jf + 1] = now
  end
  if not last or tonumber(last) < slot_n then
    jf[#jf + 1] = 'last_slot'
    jf[#jf + 1] = slot
  end

  local st, attempt, exp, holder, tok, tk, n, c, r, o, e, f = unpack(redis.call('HMGET', run,
    'st', 'att', 'exp', 'inst', 'tok', 'tk', 'n', 'c', 'r', 'o', 'e', 'f'))

  -- 2. a new run: none for a slot trimmed past, skipped behind a live earlier run, or won
  if not st then
    -- Trimmed slots (issue 18): 'trim' in the job hash is the newest slot whose run
    -- trimming deleted (_trim.lua). A scheduled or catch-up claim of a slot at or before
    -- it (and at or before the last slot claimed), for a job whose schedule starts its
    -- runs (not a later workflow step), finds no run to start: the slot ran and was
    -- trimmed, or its turn passed while newer runs ran and were trimmed.
    if scheduled and trimmed and last and (reason == 'scheduled' or reason == 'catch-up')
       and slot_n <= tonumber(last) and slot_n <= tonumber(trimmed) then
      write_job(job, jf)
      return reply('finished', 0, '', nil, '', sid, '', epoch, seq)
    end
    -- Operations: a paused job's new slot is recorded skipped, never run nor caught up
    -- (a trigger's run exists already, so it is never a new one here).
    if paused and (reason == 'scheduled' or reason == 'catch-up') then
      redis.call('HSET', run, 'st', 'skipped', 'att', 1, 'inst', inst, 'n', 1,
        'r', reason, 'c', now, 'o', 'skipped', 'e', 'job paused by ' .. paused, 'f', now)
      redis.call('ZADD', done, now, slot .. ':1')
      seq = add_history(job, hist, jf, seq, slot .. ':1')
      return reply('skipped', 1, '', nil, 'skipped', sid, inst, epoch, seq)
    end
    -- overlap: skipped while an earlier run holds a live lease, or waits for its retry
    -- (a retry is the same run going on: issue 19)
    if overlap_skip then
      local why
      for _, other in ipairs(redis.call('ZRANGEBYSCORE', open, '-inf', '(' .. slot)) do
        local ost, oexp = unpack(redis.call('HMGET', run_prefix .. other, 'st', 'exp'))
        if ost == 'running' and oexp and tonumber(oexp) > now then
          why = 'an earlier run of the job still holds its lease'
          break
        elseif ost == 'retrying' then
          why = 'an earlier run of the job waits for its retry'
        end
      end
      if why then
        redis.call('HSET', run, 'st', 'skipped', 'att', 1, 'inst', inst, 'n', 1,
          'r', reason, 'c', now, 'o', 'skipped', 'e', why, 'f', now)
        redis.call('ZADD', done, now, slot .. ':1')
        seq = add_history(job, hist, jf, seq, slot .. ':1')
        return reply('skipped', 1, '', nil, 'skipped', sid, inst, epoch, seq)
      end
    end
    local moved
    moved, epoch = server_moved(job, jf, rid, epoch, lease_ms, longest)
    if moved then
      return reply('running', 0, '', moved, '', sid, '', epoch, seq)  -- claim again after it
    end
    local expires = now + lease_ms
    redis.call('HSET', run, 'st', 'running', 'att', 1, 'tok', token, 'inst', inst,
      'exp', expires, 'tk', 0, 'n', 1, 'r', reason, 'c', now)
    redis.call('ZADD', open, slot, slot)
    seq = add_history(job, hist, jf, seq, slot .. ':1')
    return reply('won', 1, reason, expires, 'running', sid, inst, epoch, seq)
  end

  -- A claim sent again with the token that holds the run (its first try took effect and
  -- the reply was lost with the connection) answers as the first try did.
  if st == 'running' and tok == token then
    write_job(job, jf)
    local why = r
    if not why then  -- a record of store format 1 (or trimmed)
      local rec = redis.call('HGET', att, slot .. ':' .. attempt)
      why = rec and cjson.decode(rec).r or reason
    end
    return reply('won', attempt, why, exp, st, sid, holder, epoch, seq)
  end

  -- 3. finished; 4. live lease held by another attempt
  if FINISHED[st] then
    write_job(job, jf)
    return reply('finished', attempt, '', exp, st, sid, holder, epoch, seq)
  end
  attempt = tonumber(attempt)
  -- (a 'retrying' run waits for its retry's due time like a live lease: issue 19)
  if (st == 'running' or st == 'retrying') and exp and tonumber(exp) > now then
    write_job(job, jf)
    return reply('running', attempt, '', exp, st, sid, holder, epoch, seq)
  end

  -- (a new server: no attempt before its quarantine, see server_moved)
  local moved
  moved, epoch = server_moved(job, jf, rid, epoch, lease_ms, longest)
  if moved then
    return reply('running', 0, '', moved, '', sid, '', epoch, seq)
  end

  -- 5. handed over; 6. expired (escalate when the first attempt and the takeovers reach
  -- max_attempts, hand-overs not counted; else take over)
  local why
  local last_id = slot .. ':' .. attempt
  local takeovers = tonumber(tk or '')
  if not takeovers then
    -- a run written before 'tk' was kept: count the takeovers its history recorded
    takeovers = 0
    for a = 2, attempt do
      local why_a = a == attempt and r
      if not why_a then
        local raw = redis.call('HGET', run, 'h' .. a) or redis.call('HGET', att,
          slot .. ':' .. a)
        why_a = raw and cjson.decode(raw).r
      end
      if why_a == 'takeover' then
        takeovers = takeovers + 1
      end
    end
  end
  local queued_by
  if st == 'handed_over' then
    why = 'hand-over'
    -- Operations: a triggered or retried run's attempt says why (manual, retry) and who
    -- asked (operate.lua), once.
    local q, qb = unpack(redis.call('HMGET', run, 'q', 'qb'))
    if q then
      why, queued_by = q, qb
      redis.call('HDEL', run, 'q', 'qb')
    end
  elseif st == 'retrying' then  -- retries within a run (issue 19, part 1)
    why = 'retry'
    redis.call('HINCRBY', run, 'rt', 1)
  else
    if max_attempts and 1 + takeovers >= max_attempts then
      local err = 'lease lost on attempt ' .. attempt .. ' of max_attempts=' .. max_attempts
        .. ' (hand-overs not counted); escalated'
      if c and not o then
        redis.call('HSET', run, 'tk', takeovers, 'st', 'escalated', 'o', 'escalated',
          'e', err, 'f', now)
        redis.call('ZADD', done, now, last_id)
      else
        redis.call('HSET', run, 'tk', takeovers, 'st', 'escalated')
        if not c then
          end_attempt(att, done, last_id, 'escalated', err)
        end
      end
      redis.call('HDEL', run, 'tok', 'exp')
      redis.call('ZREM', open, slot)
      write_job(job, jf)
      return reply('escalated', attempt, '', nil, 'escalated', sid, holder, epoch, seq)
    end
    if c then
      if not o then
        o, e, f = 'lost', 'lease expired without renewal', now
        redis.call('ZADD', done, now, last_id)
      end
    else
      end_attempt(att, done, last_id, 'lost', 'lease expired without renewal')
    end
    why = 'takeover'
    takeovers = takeovers + 1
  end
  local expires = now + lease_ms
  local fields = {'st', 'running', 'att', attempt + 1, 'tok', token, 'inst', inst,
    'exp', expires, 'tk', takeovers, 'n', (tonumber(n) or 0) + 1, 'r', why, 'c', now}
  if c then  -- the ended attempt's record is kept as JSON (format 1's, read by history)
    fields[#fields + 1] = 'h' .. attempt
    fields[#fields + 1] = record_json(slot, attempt, holder, r, c, o, e, f,
      redis.call('HGET', run, 'b'))  -- operations: who asked for it
    redis.call('HDEL', run, 'o', 'e', 'f', 'b')
  end
  if queued_by then  -- operations: who asked for the new attempt
    fields[#fields + 1] = 'b'
    fields[#fields + 1] = queued_by
  end
  redis.call('HSET', run, unpack(fields))
  redis.call('ZADD', open, slot, slot)
  seq = add_history(job, hist, jf, seq, slot .. ':' .. (attempt + 1))
  return reply('won', attempt + 1, why, expires, 'running', sid, inst, epoch, seq)
end
