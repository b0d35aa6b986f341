-- Record a job as seen, keeping an earlier first_seen, and list its open runs.
-- KEYS[1] job hash, KEYS[2] open zset.
-- Returns {first_seen, last_slot or '', 1 if new else 0, open slot, ...}.
local new = redis.call('HSETNX', KEYS[1], 'first_seen', now)
local first, last = unpack(redis.call('HMGET', KEYS[1], 'first_seen', 'last_slot'))
local out = {first, last or '', new}
for _, slot in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  out[#out + 1] = slot
end
return out
