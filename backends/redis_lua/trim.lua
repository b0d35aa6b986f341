-- Trim one job's history outside a claim (the ticker's trimming, `anarchon prune`).
-- KEYS[1] history zset  {p/job}:hist
-- KEYS[2] attempts hash {p/job}:att
-- KEYS[3] done zset     {p/job}:done
-- KEYS[4] orphan set    {p/job}:orphan
-- KEYS[5] job hash      {p/job}:job (its 'trim', the newest slot whose run was deleted)
-- KEYS[6] hold set      {p/job}:hold (the slots of workflow runs found going on)
-- ARGV: history_size ('' = no limit), history_ttl_ms ('' = none), run key prefix
--       ({p/job}:run:), batch (the most attempts of each kind deleted), then the mode:
--   ''      trim now; returns how many attempts were deleted;
--   'list'  delete nothing; returns the ids of the attempts to trim, then those of the
--           slots in the hold set (not counted toward the batch), then those of both
--           found beyond the newest history_size (three lists);
--   'ids'   ARGV[6] = n, then n attempt ids to delete, then the slots to hold from now
--           on (the hold set is replaced); returns how many attempts were deleted.
-- A workflow step's job is trimmed with 'list', then 'ids' once the caller has left out
-- the attempts of the workflow runs that go on (backends/redis/records.py).
local mode = ARGV[5] or ''
if mode == 'list' then
  return {trim_select(KEYS[1], KEYS[3], ARGV[3], tonumber(ARGV[1]), tonumber(ARGV[2]),
    tonumber(ARGV[4]), KEYS[6])}
end
local ids
if mode == 'ids' then
  local n = tonumber(ARGV[6])
  ids = {}
  for i = 7, 6 + n do
    ids[#ids + 1] = ARGV[i]
  end
  redis.call('DEL', KEYS[6])
  for i = 7 + n, #ARGV do
    redis.call('SADD', KEYS[6], ARGV[i])
  end
else
  ids = trim_select(KEYS[1], KEYS[3], ARGV[3], tonumber(ARGV[1]), tonumber(ARGV[2]),
    tonumber(ARGV[4]), nil)
end
return trim_delete(KEYS[5], KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[3], ids)
