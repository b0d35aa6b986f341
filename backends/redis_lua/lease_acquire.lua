-- Take a named lease when it is free (lease_core.Lease; see lease_core/_named_leases.py).
-- KEYS[1] the lease hash ({P/lease/E}): ep epoch, tok number in the epoch, exp expiry
-- (ms, server clock), hold holder ('' once released). The token handed out is
-- lease_core.fence_of(ep, tok) = ep * 2^20 + tok, made by the client: Lua's numbers are
-- doubles, exact only below 2^53.
-- Fences (issue 21): the hash is never deleted, so a missing one is a name new to the
-- server or a name whose key the server lost (a restart without persistence, a failover
-- to a lagging replica). The script cannot tell them apart and does not try: both start
-- a new epoch at now, the server's clock in ms, and token number 1, which is above every
-- token the name had before (any earlier epoch is an earlier clock). A key written before
-- epochs (no ep) starts a new epoch too. When the number would reach 2^20 a new epoch
-- starts likewise. And a key that survived on a promoted replica (or a restarted server)
-- without its newest holders: 'rid' keeps the server's replication id at the last new
-- holder, and a new holder on a server with another id starts a new epoch.
-- Quarantine on a promoted server (as for jobs, _claim.lua's server_moved): a holder
-- whose acquire or renewals the failover lost may still run until its next renewal, so
-- the first acquire that finds the key's id changed on a server that was promoted takes
-- nothing: the new epoch starts with nobody holding the name until now + the longest ttl
-- known ('ttl', the last holder's, or this caller's), when every such hold has expired.
-- A key the failover lost entirely looks new and is not quarantined (its fences are
-- above all the same); a plain restart only starts the new epoch.
-- ARGV: holder, ttl_ms. Returns {epoch, number, expires} when the caller holds the name
-- (its holder is ARGV[1] and now is expires - ttl: a short reply, the hot path), else
-- {epoch, number, expires, now, holder} of the current hold ('' for none).
local ep, tok, exp, hold, rid, ttl = unpack(redis.call('HMGET', KEYS[1], 'ep', 'tok', 'exp',
  'hold', 'rid', 'ttl'))
local epoch, token, expires = tonumber(ep or '0'), tonumber(tok or '0'), tonumber(exp or '0')
if expires > now and hold ~= ARGV[1] then
  return {epoch, token, expires, now, hold or ''}
end
if expires <= now then
  local id, promoted = replication_ids()
  local moved = rid and rid ~= id
  if not ep or token + 1 >= 1048576 or moved then
    epoch = math.max(now, epoch + 1)
    token = 1
  else
    token = token + 1
  end
  if moved and promoted then
    local quiet = now + math.max(tonumber(ttl or '0'), tonumber(ARGV[2]))
    redis.call('HSET', KEYS[1], 'ep', epoch, 'tok', 0, 'exp', quiet, 'hold', '', 'rid', id)
    return {epoch, 0, quiet, now, ''}
  end
  rid = id
end
expires = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'ep', epoch, 'tok', token, 'exp', expires, 'hold', ARGV[1],
  'rid', rid or '', 'ttl', ARGV[2])
return {epoch, token, expires}
