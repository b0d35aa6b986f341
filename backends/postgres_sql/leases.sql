-- The named leases of backends/postgres/leases.py (lease_core.Lease), each under a
-- `-- name: <name>` header: the acquire is a call of the function of lease_v4.sql
-- ({lease}; a row of {meta} per name, see that file); the renewal and the release are
-- that function's branches as plain statements (same rows, same formats, so instances
-- calling the function share the store with these). Each returns only what its caller
-- reads.

-- name: grant_lease
GRANT EXECUTE ON FUNCTION {lease}(text, text, text, text, bigint) TO PUBLIC

-- name: lease_acquire
-- Take the name when it is free. Parameters: name, holder, ttl_ms.
SELECT o_held, o_token, o_expires, o_now, o_holder
FROM {lease}('acquire', %s::text, %s::text, NULL, %s::bigint)

-- name: lease_renew
-- Extend the live hold of a token: one plain UPDATE (pglease, issue 19: the function's
-- 'renew' branch, same rows and formats, without the function call); no row when the
-- token no longer holds the name. The CASE keeps the cast off rows other than leases
-- (WHERE does not short-circuit). Parameters: ttl_ms, name, token.
UPDATE {meta} AS m
SET value = split_part(m.value, ' ', 1) || ' ' || ({now} + %s::bigint)::text || ' '
            || substr(m.value, length(split_part(m.value, ' ', 1))
                               + length(split_part(m.value, ' ', 2)) + 3)
WHERE m.key = 'lease:' || %s::text
  AND split_part(m.value, ' ', 1) = %s::text
  AND CASE WHEN left(m.key, 6) = 'lease:' THEN split_part(m.value, ' ', 2)::bigint
           ELSE 0 END > {now}
RETURNING split_part(m.value, ' ', 2)::bigint

-- name: lease_release
-- Free the name if the token holds it live, keeping the token: one plain UPDATE
-- (pglease, issue 19: the function's 'release' branch, same rows and formats, without
-- the function call); a row when it did. Parameters: name, token.
UPDATE {meta} AS m SET value = split_part(m.value, ' ', 1) || ' 0 '
WHERE m.key = 'lease:' || %s::text
  AND split_part(m.value, ' ', 1) = %s::text
  AND CASE WHEN left(m.key, 6) = 'lease:' THEN split_part(m.value, ' ', 2)::bigint
           ELSE 0 END > {now}
RETURNING true
