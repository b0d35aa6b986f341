-- Record a job as seen, keeping an earlier first_seen, give it its data marker ('sid',
-- see _claim.lua section 0) if it has none yet, and list its open runs.
-- Every process that registers a job so knows its marker before it claims anything: a
-- backup that never won the job still finds a loss of its data at its first claim after
-- it, instead of taking the lost job for a new one and skipping the quarantine.
-- A job given its marker here starts an epoch ('ep' = now; see _claim.lua section 1):
-- it is new, or lost every key with no caller left that saw them, so its fences start
-- above every fence it had before; the server's replication id is recorded with it
-- ('rid', see _claim.lua server_moved), so that a failover that loses the job's first
-- win (this registration replicated, the win not) is found at the next win.
-- KEYS[1] job hash, KEYS[2] open zset; ARGV[1] a random seed of the caller's.
-- Returns {first_seen, last_slot or '', 1 if new else 0, marker, open slot, ...}.
local new = redis.call('HSETNX', KEYS[1], 'first_seen', now)
local first, last, sid = unpack(redis.call('HMGET', KEYS[1], 'first_seen', 'last_slot', 'sid'))
if not sid then
  sid = redis.sha1hex(ARGV[1] .. KEYS[1])  -- new and unique, as a claim's (see 0.)
  redis.call('HSET', KEYS[1], 'sid', sid)
  if redis.call('HSETNX', KEYS[1], 'ep', now) == 1 then
    redis.call('HSET', KEYS[1], 'rid', replication_id())
  end
end
local out = {first, last or '', new, sid}
for _, slot in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  out[#out + 1] = slot
end
return out
