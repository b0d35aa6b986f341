-- Many claims in one call, in order, each as claim.lua would make it (see _claim.lua,
-- prepended with it). For a server that is not a Cluster: only the job hashes are
-- declared, and each claim's other keys share its job hash's prefix (and hash tag).
-- KEYS: the job hash ({p/job}:job) of each claim, in order
-- ARGV: instance, longest lease (ms), then one value per claim, its fields joined by '|':
--       slot|token|lease_ms|reason|overlap_skip (1/0)|max_attempts ('' = none)|marker
--       seen ('' = none)|highest history sequence seen ('' = none)|scheduled (1/0); the
--       token is the only field that could hold a '|', and the caller sends claims whose
--       token has one through claim.lua.
-- Returns one string: each claim's claim.lua reply, in order, prefixed with its length in
-- bytes and ':' ('<length>:<reply>'), which a client splits at a fraction of the cost of
-- reading one reply per claim.
local inst, longest = ARGV[1], tonumber(ARGV[2])
local out = {}
for i, job in ipairs(KEYS) do
  local slot, token, lease_ms, reason, skip, max_attempts, seen, seen_seq, scheduled =
    string.match(ARGV[2 + i],
      '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
  local tag = string.sub(job, 1, -5)  -- without ':job'
  local r = claim(job, tag .. ':run:' .. slot, tag .. ':open', tag .. ':hist', tag .. ':att',
    tag .. ':done', slot, inst, token, tonumber(lease_ms), reason, skip == '1',
    tonumber(max_attempts), tag .. ':run:', seen, longest, tonumber(seen_seq),
    scheduled == '1')
  out[i] = #r .. ':' .. r
end
return table.concat(out)
