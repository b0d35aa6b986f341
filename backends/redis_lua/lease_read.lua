-- Who holds a named lease, read without taking it (lease_core.Lease.current_holder). Writes
-- nothing. KEYS[1] the lease hash (see lease_acquire.lua). Returns {epoch, number,
-- expires, now, holder} ('' for a name never held or released); the holder is that of a
-- live hold only when expires > now, which the client compares.
local ep, tok, exp, hold = unpack(redis.call('HMGET', KEYS[1], 'ep', 'tok', 'exp', 'hold'))
return {tonumber(ep or '0'), tonumber(tok or '0'), tonumber(exp or '0'), now, hold or ''}
