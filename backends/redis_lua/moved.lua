-- A backup's check (RedisBackend.check): which jobs' keys last took a win on another server.
-- KEYS: job hashes ({p/job}:job). Returns one flag per key, as a string: '1' when the
-- hash records the replication id ('rid') of another server than this one (a promoted
-- replica, or a restarted server, that may have lost the newest claims: a watched run
-- missing there was lost, not deleted), else '0'. Writes nothing.
local id = replication_id()
local flags = {}
for i, key in ipairs(KEYS) do
  local rid = redis.call('HGET', key, 'rid')
  flags[i] = (rid and rid ~= id) and '1' or '0'
end
return table.concat(flags)
