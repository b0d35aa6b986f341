-- The named leases of backends/postgres/leases.py (lease_core.Lease), each under a
-- `-- name: <name>` header. A lease is a row of {meta} (no table of its own, so no
-- migration): key 'lease:<name>', value '<token> <expires_ms> <holder>' (the holder is
-- everything after the second space; '' once released). Only 'lease:' rows are read or
-- written here; every time is the server's clock_timestamp(), read once per statement.

-- name: lease_acquire
-- Take the name when it is free (no row, released, or expired), with the next token;
-- renew it with the same token when this holder holds it live; otherwise change
-- nothing. ON CONFLICT re-checks the condition on the row's latest version, so two
-- callers never both take it. EXCLUDED.value is '<token> <now + ttl> <holder>': its
-- second field less the ttl is the statement's now. Returns the row as written (NULL when
-- not taken), the row before the statement, now, and the end of a failover quarantine
-- (NULL when none).
-- Failover (issue 21): {failover} (failover_v4.sql) detects a promotion. After one, a
-- new token is at least epoch << 20 (fence_of in lease_core), and nothing is taken until
-- the quarantine is over: the epoch plus this ttl, or the longest lease then live.
-- Parameters: name, holder, ttl_ms.
WITH t AS (SELECT {now} AS now),
f AS (SELECT fo.f_epoch AS epoch,
             CASE WHEN fo.f_epoch > 0
                  THEN GREATEST(fo.f_quiet, fo.f_epoch + %(ttl_ms)s::bigint) END AS quiet
      FROM {failover}(%(ttl_ms)s::bigint) fo),
won AS (
    INSERT INTO {meta} AS m (key, value)
    SELECT 'lease:' || %(name)s::text,
           GREATEST(1, f.epoch * 1048576)::text || ' '
           || (t.now + %(ttl_ms)s::bigint)::text || ' ' || %(holder)s::text
    FROM t, f
    WHERE f.quiet IS NULL OR f.quiet <= t.now
    ON CONFLICT (key) DO UPDATE
    SET value = CASE WHEN split_part(m.value, ' ', 2)::bigint
                          > split_part(EXCLUDED.value, ' ', 2)::bigint - %(ttl_ms)s::bigint
                     THEN split_part(m.value, ' ', 1)::bigint
                     ELSE GREATEST(split_part(m.value, ' ', 1)::bigint + 1,
                                   split_part(EXCLUDED.value, ' ', 1)::bigint) END::text
                || ' ' || substr(EXCLUDED.value, length(split_part(EXCLUDED.value, ' ', 1)) + 2)
    WHERE split_part(m.value, ' ', 2)::bigint
          <= split_part(EXCLUDED.value, ' ', 2)::bigint - %(ttl_ms)s::bigint
       OR substr(m.value, length(split_part(m.value, ' ', 1))
                          + length(split_part(m.value, ' ', 2)) + 3) = %(holder)s::text
    RETURNING m.value)
SELECT (SELECT value FROM won),
       (SELECT value FROM {meta} WHERE key = 'lease:' || %(name)s::text),
       (SELECT now FROM t),
       (SELECT quiet FROM f)

-- name: lease_renew
-- Set the live hold of a token to end at now + ttl. Parameters: name, token, ttl_ms.
-- The CASE keeps the cast off rows other than leases (WHERE does not short-circuit).
WITH t AS (SELECT {now} AS now)
UPDATE {meta} AS m
SET value = split_part(m.value, ' ', 1) || ' ' || (t.now + %(ttl_ms)s::bigint)::text || ' '
            || substr(m.value, length(split_part(m.value, ' ', 1))
                               + length(split_part(m.value, ' ', 2)) + 3)
FROM t
WHERE m.key = 'lease:' || %(name)s::text
  AND split_part(m.value, ' ', 1) = %(token)s::text
  AND CASE WHEN left(m.key, 6) = 'lease:' THEN split_part(m.value, ' ', 2)::bigint
           ELSE 0 END > t.now
RETURNING t.now + %(ttl_ms)s::bigint

-- name: lease_release
-- Free the name now if the token holds it live, keeping the token. Parameters: name, token.
UPDATE {meta} AS m SET value = split_part(m.value, ' ', 1) || ' 0 '
WHERE m.key = 'lease:' || %(name)s::text
  AND split_part(m.value, ' ', 1) = %(token)s::text
  AND CASE WHEN left(m.key, 6) = 'lease:' THEN split_part(m.value, ' ', 2)::bigint
           ELSE 0 END > {now}
RETURNING 1
