-- The named leases of backends/postgres/leases.py (lease_core.Lease), each under a
-- `-- name: <name>` header: calls of the function of lease_v4.sql ({lease}), which
-- holds the statements (a row of {meta} per name; see that file).

-- name: grant_lease
GRANT EXECUTE ON FUNCTION {lease}(text, text, text, text, bigint) TO PUBLIC

-- name: lease_call
-- One acquire, renewal or release. Parameters: op ('acquire', 'renew' or 'release'),
-- name, holder (acquire), token (renew, release), ttl_ms (acquire, renew).
SELECT o_held, o_token, o_expires, o_now, o_holder
FROM {lease}(%s::text, %s::text, %s::text, %s::text, %s::bigint)
