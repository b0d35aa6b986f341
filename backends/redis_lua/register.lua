-- Record a job as seen, keeping an earlier first_seen, and list its open runs.
-- KEYS[1] job hash, KEYS[2] open zset (store format 1); ARGV: run key prefix
-- ({p/job}:run:). The open runs are those the job hash lists (ol; the open zset when it
-- has none) that are still running or handed over.
-- Returns {first_seen, last_slot or '', 1 if new else 0, open slot, ...}.
local new = redis.call('HSETNX', KEYS[1], 'first_seen', now)
local first, last, listed = unpack(redis.call('HMGET', KEYS[1], 'first_seen', 'last_slot',
  'ol'))
local out = {first, last or '', new}
local slots = {}
if listed then
  for slot in string.gmatch(listed, '%S+') do
    slots[#slots + 1] = slot
  end
else
  slots = redis.call('ZRANGE', KEYS[2], 0, -1)
end
for _, slot in ipairs(slots) do
  local st = redis.call('HGET', ARGV[1] .. slot, 'st')
  if st == 'running' or st == 'handed_over' then
    out[#out + 1] = slot
  end
end
return out
