-- Trim one job's history outside a claim (the ticker's trimming, `anarchon prune`).
-- KEYS[1] history zset  {p/job}:hist
-- KEYS[2] attempts hash {p/job}:att
-- KEYS[3] done zset     {p/job}:done
-- KEYS[4] orphan set    {p/job}:orphan
-- KEYS[5] job hash      {p/job}:job (its 'trim', the newest slot whose run was deleted)
-- ARGV: history_size ('' = no limit), history_ttl_ms ('' = none), run key prefix
--       ({p/job}:run:), batch (the most attempts of each kind deleted)
-- Returns how many attempts were deleted.
return trim_history(KEYS[5], KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[3], tonumber(ARGV[1]),
  tonumber(ARGV[2]), tonumber(ARGV[4]))
