-- Prepended to the named leases' scripts (lease_*.lua) instead of _prelude.lua: they need
-- only the server's clock, so they skip the prelude's helpers (defined again at every
-- call of a script that includes them).
-- Redis 6.2 needs effects replication switched on before a write that follows TIME.
if redis.replicate_commands then
  pcall(redis.replicate_commands)
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
