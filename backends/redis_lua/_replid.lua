-- The server's replication id ('master_replid' of INFO replication; '' when the server
-- prints none), cut out with plain finds (cheaper for the server than a pattern, as
-- _claim.lua's info_value). Included by the scripts that record or compare it.
local function replication_id()
  local info = redis.call('INFO', 'replication')
  local at = string.find(info, '\nmaster_replid:', 1, true)
  if not at then
    return ''
  end
  return string.sub(info, at + 15, (string.find(info, '\r', at, true) or (#info + 1)) - 1)
end
