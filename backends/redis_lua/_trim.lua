-- Trim one job's history: finished attempts beyond its newest history_size (nil: no
-- limit), and attempts that finished history_ttl ms ago or more (nil: none), at most
-- `limit` ids of each kind per call; then delete finished runs left with no attempt, and raise the
-- job hash's 'trim' to the newest of their slots (never lowered; see _claim.lua, 2.: a
-- scheduled claim of a slot at or before it starts no run). Returns how many attempts
-- it deleted. Reads both store formats (see _prelude.lua).
local function trim_history(job, hist, att, done, orphan, run_prefix, history_size,
                            history_ttl, limit)
  local removed = {}
  local newest  -- the newest slot whose run is deleted here
  local function delete_run(rk, s)
    redis.call('DEL', rk)
    local n = tonumber(s)
    if n and (not newest or n > newest) then
      newest = n
    end
  end
  if history_size then
    -- the oldest beyond the newest history_size, less those not finished (an open run's:
    -- deleting it would leave the run with no history while it runs)
    local excess = redis.call('ZCARD', hist) - history_size
    local from = 0
    while excess > from and #removed < limit do
      local upto = math.min(excess, from + limit) - 1
      for _, id in ipairs(redis.call('ZRANGE', hist, from, upto)) do
        if #removed < limit and redis.call('ZSCORE', done, id) then
          removed[#removed + 1] = id
        end
      end
      from = upto + 1
    end
  end
  if history_ttl then
    local old = redis.call('ZRANGEBYSCORE', done, '-inf', '(' .. (now - history_ttl),
      'LIMIT', 0, limit)
    for _, id in ipairs(old) do
      removed[#removed + 1] = id
    end
  end
  if #removed == 0 then
    return 0
  end
  local count = 0
  for _, id in ipairs(removed) do
    if redis.call('ZREM', hist, id) == 1 then
      count = count + 1
      redis.call('HDEL', att, id)
      redis.call('ZREM', done, id)
      local s, a = string.match(id, '^(.*):(%d+)$')
      local rk = run_prefix .. s
      local current = redis.call('HGET', rk, 'att')
      if current then
        if current == a then  -- the current attempt's record (format 2)
          redis.call('HDEL', rk, 'c', 'r', 'o', 'e', 'f')
        else
          redis.call('HDEL', rk, 'h' .. a)
        end
        if redis.call('HINCRBY', rk, 'n', -1) <= 0 then
          if FINISHED[redis.call('HGET', rk, 'st')] then
            delete_run(rk, s)  -- a finished run left with no attempt goes at once
          else
            redis.call('SADD', orphan, s)
          end
        end
      end
    end
  end
  -- finished runs that no longer have any attempt are deleted
  for _, s in ipairs(redis.call('SMEMBERS', orphan)) do
    local rk = run_prefix .. s
    local st, n = unpack(redis.call('HMGET', rk, 'st', 'n'))
    if not st or tonumber(n or '0') > 0 then
      redis.call('SREM', orphan, s)
    elseif FINISHED[st] then
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
