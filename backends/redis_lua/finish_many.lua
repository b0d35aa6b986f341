-- Many finishes in one call, in order, each as finish.lua would make it (see _finish.lua,
-- prepended with it). For a server that is not a Cluster: only the run hashes are
-- declared, and each finish's other keys share its run hash's prefix (and hash tag).
-- KEYS: the run hash ({p/job}:run:<slot>) of each finish, in order
-- ARGV: one value per finish, 'token|slot|outcome|' then, when there is an error, 'E' and
--       its text (which may hold any character; nothing after the third '|': no error).
--       The token is the only other field that could hold a '|', and the caller sends
--       finishes whose token has one through finish.lua.
-- Returns one string: '1' (done) or '0' per finish, in order.
local out = {}
for i, run in ipairs(KEYS) do
  local token, slot, outcome, rest = string.match(ARGV[i], '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
  local err = nil
  if rest ~= '' then
    err = string.sub(rest, 2)
  end
  local tag = string.sub(run, 1, #run - #slot - 5)  -- without ':run:<slot>'
  out[i] = finish(run, tag .. ':open', tag .. ':att', tag .. ':done', token, slot, outcome,
    err)
end
return table.concat(out)
