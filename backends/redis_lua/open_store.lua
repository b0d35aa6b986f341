-- Check and record the store format. A store written by a newer format is left
-- untouched and its format returned, so the caller refuses it; an older one is marked
-- with this format (the scripts read every older layout, and an older anarchon then
-- refuses the store instead of missing what this one writes).
-- KEYS[1] meta hash; ARGV: this library's format. Returns the store's format.
-- Claims and named leases read INFO inside their scripts (the server's replication id),
-- and INFO is in the ACL category @dangerous: a user that may not run it is refused here,
-- at start, rather than at each claim that would win.
redis.call('INFO', 'replication')
local current = redis.call('HGET', KEYS[1], 'format')
if current and tonumber(current) >= tonumber(ARGV[1]) then
  return tonumber(current)
end
if current then
  redis.call('HSET', KEYS[1], 'format', ARGV[1], 'upgraded', now)
else
  redis.call('HSET', KEYS[1], 'format', ARGV[1], 'created', now)
end
return tonumber(ARGV[1])
