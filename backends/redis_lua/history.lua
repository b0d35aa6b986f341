-- Read the newest attempt records of one job (read only), of either store format (see
-- _prelude.lua). KEYS[1] history zset, KEYS[2] attempts hash; ARGV: limit, run key
-- prefix ({p/job}:run:). Returns JSON records.
local out = {}
for _, id in ipairs(redis.call('ZREVRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)) do
  local slot, a = string.match(id, '^(.*):(%d+)$')
  local current, inst, r, c, o, e, f, old, b = unpack(redis.call('HMGET', ARGV[2] .. slot,
    'att', 'inst', 'r', 'c', 'o', 'e', 'f', 'h' .. a, 'b'))
  local raw
  if current == a and c then
    raw = record_json(slot, a, inst, r, c, o, e, f, b)
  else
    raw = old or redis.call('HGET', KEYS[2], id)
  end
  if raw then
    out[#out + 1] = raw
  end
end
return out
