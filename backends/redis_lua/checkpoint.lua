-- Set (ARGV[2] = 'set') or delete (ARGV[2] = 'del') the run's checkpoint, fenced by the
-- holder's token. KEYS[1] run hash; ARGV: token, mode, JSON text. Returns 1 or 0.
local st, tok = unpack(redis.call('HMGET', KEYS[1], 'st', 'tok'))
if st ~= 'running' or tok ~= ARGV[1] then
  return 0
end
if ARGV[2] == 'set' then
  redis.call('HSET', KEYS[1], 'cp', ARGV[3])
else
  redis.call('HDEL', KEYS[1], 'cp')
end
return 1
