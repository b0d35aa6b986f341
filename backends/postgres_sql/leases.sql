-- The named leases of backends/postgres/leases.py (lease_core.Lease), each under a
-- `-- name: <name>` header: calls of the function of lease_v4.sql ({lease}), which
-- holds the statements (a row of {meta} per name; see that file). Each selects only the
-- columns its caller reads.

-- name: grant_lease
GRANT EXECUTE ON FUNCTION {lease}(text, text, text, text, bigint) TO PUBLIC

-- name: lease_acquire
-- Take the name when it is free. Parameters: name, holder, ttl_ms.
SELECT o_held, o_token, o_expires, o_now, o_holder
FROM {lease}('acquire', %s::text, %s::text, NULL, %s::bigint)

-- name: lease_renew
-- Extend the live hold of a token (o_expires NULL when it no longer holds the name).
-- Parameters: name, token, ttl_ms.
SELECT o_expires FROM {lease}('renew', %s::text, NULL, %s::text, %s::bigint)

-- name: lease_release
-- Free the name if the token holds it live. Parameters: name, token.
SELECT o_held FROM {lease}('release', %s::text, NULL, %s::text, NULL)

-- name: lease_read
-- Who holds the name, read without taking it (a plain read, no function: it works on a
-- store of any code version). Parameter: name. One row: the server's clock (ms), the
-- lease's value '<token> <expires_ms> <holder>' (NULL for a name never held), and the
-- 'failover' row '<timeline> <epoch> <quiet>' (failover_v4.sql; NULL before v4): until
-- <quiet> no name is taken.
SELECT {now}, (SELECT m.value FROM {meta} m WHERE m.key = 'lease:' || %s::text),
       (SELECT m.value FROM {meta} m WHERE m.key = 'failover')
