-- Read the newest attempt records of one job (read only).
-- KEYS[1] history zset, KEYS[2] attempts hash; ARGV: limit. Returns JSON records.
local out = {}
for _, id in ipairs(redis.call('ZREVRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)) do
  local raw = redis.call('HGET', KEYS[2], id)
  if raw then
    out[#out + 1] = raw
  end
end
return out
