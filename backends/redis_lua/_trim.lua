-- Trim one job's history (trim.lua): trim_select lists the finished attempts beyond its
-- newest history_size and those that finished history_ttl ms ago or more; trim_delete
-- deletes attempts, then the finished runs left with no attempt, and raises the job
-- hash's 'trim' to the newest of their slots (never lowered; see _claim.lua, 2.: a
-- scheduled claim of a slot at or before it starts no run). Both read both store formats
-- (see _prelude.lua).
-- Never trimmed either: the attempt of a run cancelled with a grace that has not passed
-- (operate.lua: the run keeps its holder's token 'tok', 'exp' the end of the grace), so
-- the holder's heartbeat still finds the run cancelled; it goes once the grace has passed
-- (as memory and PostgreSQL trim).
-- kept(rk, a): whether the attempt a of the run rk is kept so (a grace with a its current
-- attempt), or the run is open (running, handed over, waiting for a retry: its attempts,
-- the run's recovery log, stay until it ends, as memory and PostgreSQL trim).
-- settled(rk): whether the run rk is finished and out of any grace (it may go).
local function read_run(rk)
  return unpack(redis.call('HMGET', rk, 'st', 'tok', 'exp', 'att'))
end
local function in_grace(st, tok, exp, current, a)
  return st == 'cancelled' and tok ~= false and tok ~= '' and (a == nil or current == a)
    and (tonumber(exp) or 0) > now
end
local function kept(rk, a)
  local st, tok, exp, current = read_run(rk)
  return (st and not FINISHED[st]) or in_grace(st, tok, exp, current, a)
end
local function settled(rk)
  local st, tok, exp, current = read_run(rk)
  return FINISHED[st] and not in_grace(st, tok, exp, current, nil)
end
-- The attempts to trim (finished, out of a grace): beyond the newest history_size (nil: no
-- limit), oldest first, and those that finished history_ttl ms ago or more (nil: none), at
-- most `limit` of each kind. hold (a set of slots, or nil): the ids of those slots are
-- returned apart (second list), not counted, so that a workflow run that goes on
-- (backends/redis/records.py) never keeps the attempts behind it from their turn. The
-- third list: the ids of both found beyond the newest history_size (a workflow run that
-- ended within the ttl keeps its attempts by age only).
local function trim_select(hist, done, run_prefix, history_size, history_ttl, limit, hold)
  local removed, skipped, beyond = {}, {}, {}
  local function trimmable(id)
    local s, a = string.match(id, '^(.*):(%d+)$')
    return not s or not kept(run_prefix .. s, a)
  end
  local function held(id)
    return hold and redis.call('SISMEMBER', hold, string.match(id, '^(.*):') or id) == 1
  end
  local taken  -- how many of the current kind are removed (at most limit)
  local function take(id)  -- a trimmable id: set apart when held, else removed
    if held(id) then
      skipped[#skipped + 1] = id
    else
      removed[#removed + 1] = id
      taken = taken + 1
    end
  end
  if history_size then
    -- the oldest beyond the newest history_size, less those not finished (an open run's:
    -- deleting it would leave the run with no history while it runs)
    local excess = redis.call('ZCARD', hist) - history_size
    local from = 0
    taken = 0
    while excess > from and taken < limit do
      local upto = math.min(excess, from + limit) - 1
      for _, id in ipairs(redis.call('ZRANGE', hist, from, upto)) do
        if taken < limit and redis.call('ZSCORE', done, id) and trimmable(id) then
          beyond[#beyond + 1] = id
          take(id)
        end
      end
      from = upto + 1
    end
  end
  if history_ttl then
    -- read on past the attempts kept (at most one per run in a grace), up to a batch
    local from = 0
    taken = 0
    while taken < limit do
      local old = redis.call('ZRANGEBYSCORE', done, '-inf', '(' .. (now - history_ttl),
        'LIMIT', from, limit)
      for _, id in ipairs(old) do
        if taken < limit and trimmable(id) then
          take(id)
        end
      end
      if #old < limit then
        break
      end
      from = from + limit
    end
  end
  return removed, skipped, beyond
end

-- Delete the attempts `ids` (each still finished and out of a grace), then the finished
-- runs left with no attempt; raise the job's 'trim' mark. Returns how many were deleted.
local function trim_delete(job, hist, att, done, orphan, run_prefix, ids)
  local newest  -- the newest slot whose run is deleted here
  local function delete_run(rk, s)
    redis.call('DEL', rk)
    local n = tonumber(s)
    if n and (not newest or n > newest) then
      newest = n
    end
  end
  local count = 0
  for _, id in ipairs(ids) do
    local s, a = string.match(id, '^(.*):(%d+)$')
    if redis.call('ZSCORE', done, id) and (not s or not kept(run_prefix .. s, a))
        and redis.call('ZREM', hist, id) == 1 then
      count = count + 1
      redis.call('HDEL', att, id)
      redis.call('ZREM', done, id)
      local rk = run_prefix .. s
      local current = redis.call('HGET', rk, 'att')
      if current then
        if current == a then  -- the current attempt's record (format 2)
          redis.call('HDEL', rk, 'c', 'r', 'o', 'e', 'f')
        else
          redis.call('HDEL', rk, 'h' .. a)
        end
        if redis.call('HINCRBY', rk, 'n', -1) <= 0 then
          if settled(rk) then
            delete_run(rk, s)  -- a finished run left with no attempt goes at once
          else
            redis.call('SADD', orphan, s)
          end
        end
      end
    end
  end
  if count == 0 then
    return 0
  end
  -- finished runs that no longer have any attempt are deleted
  for _, s in ipairs(redis.call('SMEMBERS', orphan)) do
    local rk = run_prefix .. s
    local st, n = unpack(redis.call('HMGET', rk, 'st', 'n'))
    if not st or tonumber(n or '0') > 0 then
      redis.call('SREM', orphan, s)
    elseif settled(rk) then  -- in a grace: left for a later trim
      delete_run(rk, s)
      redis.call('SREM', orphan, s)
    end
  end
  if newest then
    local trimmed = tonumber(redis.call('HGET', job, 'trim'))
    if not trimmed or trimmed < newest then
      redis.call('HSET', job, 'trim', string.format('%d', newest))
    end
  end
  return count
end
