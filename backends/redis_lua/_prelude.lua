-- Prepended to every anarchon script by backends/redis.py.
-- Redis 6.2 needs effects replication switched on before a write that follows TIME;
-- Redis 7+ and Valkey always replicate effects and keep the call as a deprecated no-op.
if redis.replicate_commands then
  pcall(redis.replicate_commands)
end

-- The store's clock, in epoch milliseconds. Leases never use the client's clock.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local FINISHED = {completed = true, failed = true, timed_out = true, escalated = true,
  skipped = true, cancelled = true}

-- Store format 2 keeps the record of a run's current attempt in the run hash (r reason,
-- c claimed at, o outcome, e error, f finished at; instance and attempt are the run's
-- inst and att) and the records of its earlier attempts as JSON under h<attempt>.
-- Format 1 kept every record as JSON in the attempts hash {p/job}:att; a run it wrote
-- has no 'c', and its records are read (and ended) there.

-- End a format-1 attempt record that has no outcome yet (outcome, error, finish time).
-- att: hash of attempt id -> JSON; done: zset of finished attempt ids by finish time.
local function end_attempt(att, done, id, outcome, err)
  local raw = redis.call('HGET', att, id)
  if not raw then
    return
  end
  local rec = cjson.decode(raw)
  if rec.o then
    return
  end
  rec.o = outcome
  rec.e = err
  rec.f = now
  redis.call('HSET', att, id, cjson.encode(rec))
  redis.call('ZADD', done, now, id)
end

-- A format-2 record as the JSON of a format-1 one (what history() reads); a missing
-- field (false, as HMGET gives it) is left out. b: who asked for the attempt (an
-- operation's trigger or retry; the run hash's 'b').
local function record_json(slot, attempt, inst, r, c, o, e, f, b)
  return cjson.encode({s = tonumber(slot), a = tonumber(attempt), i = inst or nil,
    r = r or nil, c = tonumber(c), o = o or nil, e = e or nil, f = tonumber(f),
    b = b or nil})
end
