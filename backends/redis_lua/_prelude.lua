-- Prepended to every anarchon script by backends/redis.py.
-- Redis 6.2 needs effects replication switched on before a write that follows TIME;
-- Redis 7+ and Valkey always replicate effects and keep the call as a deprecated no-op.
if redis.replicate_commands then
  pcall(redis.replicate_commands)
end

-- The store's clock, in epoch milliseconds. Leases never use the client's clock.
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local now = server_now()

-- Set outcome, error and finished time on an attempt record that has no outcome yet.
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
