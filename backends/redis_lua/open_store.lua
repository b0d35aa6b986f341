-- Check and record the store format. A store written by a newer format is left
-- untouched and its format returned, so the caller refuses it; an older one is marked
-- with this format (the scripts read every older layout, and an older anarchon then
-- refuses the store instead of missing what this one writes).
-- KEYS[1] meta hash, KEYS[2] members zset; ARGV: this library's format, how long (ms)
-- members.lua keeps an ended membership. Returns {the store's format, the
-- server's maxmemory-policy ('' when INFO does not print it), 1 if the server is a
-- Cluster node else 0}: a policy that may evict any key (allkeys-*) can drop live
-- leases, which the caller warns about; a Cluster node needs a Cluster client.
-- Claims and named leases read INFO inside their scripts (the server's replication id),
-- and INFO is in the ACL category @dangerous: a user that may not run it is refused here,
-- at start, rather than at each claim that would win.
redis.call('INFO', 'replication')
local memory = redis.call('INFO', 'memory')
local policy = ''
local at = string.find(memory, 'maxmemory_policy:', 1, true)
if at then
  policy = string.sub(memory, at + 17, (string.find(memory, '\r', at, true) or (#memory + 1)) - 1)
end
local clustered = 0
if string.find(redis.call('INFO', 'cluster'), 'cluster_enabled:1', 1, true) then
  clustered = 1
end
-- A key of another type, or a format that is not a number: not an anarchon store's
-- meta (another application's key under this prefix); returned as found, written never.
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'none' and kind ~= 'hash' then
  return {'type ' .. kind, policy, clustered}
end
-- No meta, but a key {P}:members (KEYS[2]) that is no zset, or holds an entry scored
-- before what membership renewals keep (ARGV[2], ms before now): another application's
-- key under this prefix, whose entries the first renewal would delete (members.lua);
-- returned as found, nothing written. A fleet's own after a loss of the data (every {P}
-- key is in one slot, lost together) holds only memberships renewed since.
if kind == 'none' then
  local members = redis.call('TYPE', KEYS[2])['ok']
  if members ~= 'none' and (members ~= 'zset' or
      redis.call('ZCOUNT', KEYS[2], '-inf', '(' .. (now - tonumber(ARGV[2]))) > 0) then
    return {'key ' .. KEYS[2], policy, clustered}
  end
end
local current = redis.call('HGET', KEYS[1], 'format')
-- A hash without a format holds only the fields a store keeps there, written again after
-- a loss of its format (the workflows' steps, the schedules); a field of another name is
-- another application's hash under this prefix: returned as found, written never.
if kind == 'hash' and not current then
  for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
    local head = string.sub(field, 1, 9)
    if field ~= 'created' and field ~= 'upgraded' and head ~= 'workflow:'
        and head ~= 'schedule:' then
      return {'field ' .. field, policy, clustered}
    end
  end
end
if current and not tonumber(current) then
  return {current, policy, clustered}
end
if current and tonumber(current) >= tonumber(ARGV[1]) then
  return {tonumber(current), policy, clustered}
end
if current then
  redis.call('HSET', KEYS[1], 'format', ARGV[1], 'upgraded', now)
else
  redis.call('HSET', KEYS[1], 'format', ARGV[1], 'created', now)
end
return {tonumber(ARGV[1]), policy, clustered}
