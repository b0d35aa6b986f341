-- Many claims in one call, in order, each as claim.lua would make it (see _claim.lua,
-- prepended with it). For a server that is not a Cluster: only the job hashes are
-- declared, and each claim's other keys share its job hash's prefix (and hash tag).
-- KEYS: the job hash ({p/job}:job) of each claim, in order
-- ARGV: instance, longest lease (ms), then 7 values per claim: slot, token, lease_ms,
--       reason, overlap_skip (1/0), max_attempts ('' = none), marker seen ('' = none)
-- Returns one reply of claim.lua per claim, in order.
local inst, longest = ARGV[1], tonumber(ARGV[2])
local out = {}
for i, job in ipairs(KEYS) do
  local at = 2 + (i - 1) * 7
  local slot = ARGV[at + 1]
  local tag = string.sub(job, 1, -5)  -- without ':job'
  out[i] = claim(job, tag .. ':run:' .. slot, tag .. ':open', tag .. ':hist', tag .. ':att',
    tag .. ':done', slot, inst, ARGV[at + 2], tonumber(ARGV[at + 3]), ARGV[at + 4],
    ARGV[at + 5] == '1', tonumber(ARGV[at + 6]), tag .. ':run:', ARGV[at + 7], longest)
end
return out
