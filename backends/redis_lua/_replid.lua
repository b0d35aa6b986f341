-- The server's replication id ('master_replid' of INFO replication; '' when the server
-- prints none), cut out with plain finds (cheaper for the server than a pattern, as
-- _claim.lua's info_value). Included by the scripts that record or compare it.
local function info_field(info, name)
  local at = string.find(info, name, 1, true)
  if not at then
    return ''
  end
  return string.sub(info, at + #name, (string.find(info, '\r', at, true) or (#info + 1)) - 1)
end

-- The id, and whether the server was promoted: it reports a non-zero 'master_replid2'
-- (it took over another server's history, so it may have missed its newest writes).
local function replication_ids()
  local info = redis.call('INFO', 'replication')
  return info_field(info, '\nmaster_replid:'),
    string.find(info_field(info, '\nmaster_replid2:'), '[1-9a-f]') ~= nil
end

local function replication_id()
  return (replication_ids())
end
