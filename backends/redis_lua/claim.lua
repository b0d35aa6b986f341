-- Win, take over, or find the state of one run (see _claim.lua, prepended with it).
-- KEYS: job hash, run hash, open zset, history zset, attempts hash, done zset
-- ARGV: slot, instance, token, lease_ms, reason, overlap_skip (1/0),
--       max_attempts ('' = none), run key prefix ({p/job}:run:), marker seen
--       ('' = none), longest lease (ms), highest history sequence seen ('' = none),
--       scheduled (1/0: the job's schedule starts its runs, see _claim.lua)
-- Returns 'status|now|attempt|reason|expires|run_status|marker|epoch|seq|instance' (see
-- _claim.lua).
return claim(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], ARGV[1], ARGV[2], ARGV[3],
  tonumber(ARGV[4]), ARGV[5], ARGV[6] == '1', tonumber(ARGV[7]), ARGV[8], ARGV[9],
  tonumber(ARGV[10]), tonumber(ARGV[11]), ARGV[12] == '1')
