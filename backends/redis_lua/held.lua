-- Trimming a workflow's steps (backends/redis/records.py): which of the slots given keep
-- their workflow run going, as far as one step's runs tell (read only).
-- KEYS[1] attempts hash {p/step}:att (the records of store format 1)
-- ARGV: the step's run key prefix ({p/step}:run:), history_ttl_ms ('' = none), the slots.
-- Returns two lists of slots: those whose run of this step is open (running, handed
-- over, waiting for a retry): the workflow run goes on, and its steps' attempts are all
-- kept; then, with a ttl, those whose run of this step ended less than history_ttl_ms
-- ago: the workflow run ended within the ttl, and its steps' attempts are kept by age
-- (not beyond the newest history_size).
local ttl = tonumber(ARGV[2])
local going, recent = {}, {}
for i = 3, #ARGV do
  local s = ARGV[i]
  local st, att, c, f = unpack(redis.call('HMGET', ARGV[1] .. s, 'st', 'att', 'c', 'f'))
  if st and not FINISHED[st] then
    going[#going + 1] = s
  elseif st and ttl then
    if not c and att then  -- the current attempt's record is of store format 1
      local raw = redis.call('HGET', KEYS[1], s .. ':' .. att)
      f = raw and cjson.decode(raw).f
    end
    if tonumber(f) ~= nil and tonumber(f) >= now - ttl then
      recent[#recent + 1] = s
    end
  end
end
return {going, recent}
