-- Check and record the store format. A store written by a newer format is left
-- untouched and its format returned, so the caller refuses it.
-- KEYS[1] meta hash; ARGV: this library's format. Returns the store's format.
local current = redis.call('HGET', KEYS[1], 'format')
if current then
  return tonumber(current)
end
redis.call('HSET', KEYS[1], 'format', ARGV[1], 'created', now)
return tonumber(ARGV[1])
