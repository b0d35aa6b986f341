-- Renew one instance's membership of the fleet and list the live members.
-- KEYS[1] the members zset ({P}:members: instance id -> end of its membership, ms, on the
-- server's clock); ARGV: instance id, ttl (ms), how long an ended membership is kept (ms).
-- Returns the live members (membership ending after now), the caller included.
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - tonumber(ARGV[3])))
return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
