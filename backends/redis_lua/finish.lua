-- End the holder's attempt with an outcome (see _finish.lua, prepended with it).
-- KEYS[1] run hash, KEYS[2] open zset, KEYS[3] attempts hash, KEYS[4] done zset
-- ARGV: token, slot, outcome[, error] (no fourth argument: no error).
-- Returns 1 when done, else 0.
return finish(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
