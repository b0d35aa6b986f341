-- The statements of backends/postgres.py, each under a `-- name: <name>` header.
--
-- Loaded once (importlib.resources) and filled per store by str.format with quoted
-- identifiers only: {runs}, {attempts}, {jobs}, {meta}, the index names, this release's
-- claim functions {claim} and {batch} (<table>_claim_v<N> and <table>_batch_v<N>, N being
-- CODE_VERSION in backends/postgres: the version is written there only) and its finish
-- function {finish} (<table>_end_v<N>), the older names {claim_v1}, {claim_v2},
-- {batch_v2}, {claim_v3} and {batch_v3}, and {now}, the server's clock in epoch
-- milliseconds. Parameters are %s placeholders, or %(name)s ones in a statement that uses
-- a value more than once (each value is then passed once; one style per statement).
-- Comment lines are dropped on loading.
-- The claim function lives in its own file, claim_v<N>.sql, its version in its name.

-- name: find_tables
-- The schema (the one given, else where the search_path finds the runs table, as every
-- statement naming it unqualified does, else the current schema, where creation puts
-- it: a schema of the user's own first in the path, such as "$user", holding no store,
-- hides none in a later one), which of the four tables exist in it, and whether the claim functions of
-- this release all exist, the claim function (the first name) with its number of
-- parameters (an earlier build of this unreleased version made it with fewer), the
-- open runs' index of this release (create_runs_open), and the functions of BODY_MARKS
-- (statements.py) with the text their body has in this build (an earlier build's body
-- lacks it); last, whether the functions of this release all exist by name (a store of
-- newer store code keeps them, as calls of its own, with other bodies).
SELECT n.nspname::text,
       ARRAY(SELECT c.relname::text FROM pg_catalog.pg_class c
             WHERE c.relnamespace = n.oid AND c.relname = ANY(%(tables)s::text[])),
       NOT EXISTS (SELECT 1 FROM unnest(%(functions)s::text[]) AS f(name)
                   WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_proc p
                                     WHERE p.pronamespace = n.oid AND p.proname = f.name))
       AND EXISTS (SELECT 1 FROM pg_catalog.pg_proc p
                   WHERE p.pronamespace = n.oid
                     AND p.proname = (%(functions)s::text[])[1]
                     AND p.pronargs = %(claim_args)s::integer)
       AND EXISTS (SELECT 1 FROM pg_catalog.pg_class c
                   WHERE c.relnamespace = n.oid AND c.relname = %(open_index)s::text)
       AND NOT EXISTS (SELECT 1 FROM unnest(%(marked)s::text[], %(marks)s::text[]) AS m(name, mark)
                       WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_proc p
                                         WHERE p.pronamespace = n.oid AND p.proname = m.name
                                           AND strpos(p.prosrc, m.mark) > 0)),
       NOT EXISTS (SELECT 1 FROM unnest(%(functions)s::text[]) AS f(name)
                   WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_proc p
                                     WHERE p.pronamespace = n.oid AND p.proname = f.name))
FROM pg_catalog.pg_namespace n
WHERE n.nspname = COALESCE(
    %(schema)s::text,
    (SELECT s.nspname::text FROM pg_catalog.pg_class r
     JOIN pg_catalog.pg_namespace s ON s.oid = r.relnamespace
     WHERE r.oid = to_regclass(quote_ident(%(name)s::text)) AND r.relkind IN ('r', 'p')),
    current_schema())

-- name: read_meta
-- The table format, the store code version (absent before store code v2) and a fill of
-- a new column still to make after an upgrade (operations.sql, mark_claimed_at_fill).
SELECT key, value FROM {meta} WHERE key IN ('format', 'code', 'fill')

-- name: lock_creation
-- Creation and upgrades of one store wait for each other: a transaction-scoped advisory
-- lock on a key of the table's name (schema.py, StoreSchema._create). Also answers the
-- table's schema as the store resolves it (find_tables; NULL when the search_path names
-- no existing schema). Parameters: the key, the table's schema as spelled (NULL: none),
-- the table's name.
SELECT pg_advisory_xact_lock(%s::bigint), COALESCE(
    %s::text,
    (SELECT s.nspname::text FROM pg_catalog.pg_class r
     JOIN pg_catalog.pg_namespace s ON s.oid = r.relnamespace
     WHERE r.oid = to_regclass(quote_ident(%s::text)) AND r.relkind IN ('r', 'p')),
    current_schema())

-- name: resolved_schema_first
-- A table named without its schema and found later in the search_path (find_tables) is
-- created and upgraded there: the statements name what they make without a schema too,
-- which would make it in the first schema of the path. Its schema goes first, for the
-- transaction only. Parameters: the schema lock_creation answered.
SELECT set_config('search_path',
                  quote_ident(%s::text) || ', ' || current_setting('search_path'), true)

-- name: bound_lock_waits
-- Creation and upgrades wait at most this long (ms) for a table lock held by a
-- transaction in flight, instead of queueing every claim behind their own lock request.
SELECT set_config('lock_timeout', %s::text, true)

-- name: create_meta
CREATE TABLE IF NOT EXISTS {meta} (
    key text PRIMARY KEY,
    value text NOT NULL
)

-- name: create_jobs
CREATE TABLE IF NOT EXISTS {jobs} (
    job text PRIMARY KEY,
    first_seen_ms bigint NOT NULL,
    last_slot bigint,
    seq bigint NOT NULL DEFAULT 0
)

-- name: create_runs
-- takeovers: how many attempts of the run started by taking over an expired lease
-- (max_attempts counts them and the first attempt, never hand-overs). NULL on runs
-- written by store code v1, whose claim function did not keep it.
CREATE TABLE IF NOT EXISTS {runs} (
    job text NOT NULL,
    slot bigint NOT NULL,
    status text NOT NULL,
    attempt integer NOT NULL,
    token text,
    instance_id text,
    expires_ms bigint,
    checkpoint text,
    takeovers integer,
    PRIMARY KEY (job, slot)
)

-- name: create_runs_open
-- The open runs (running, handed over, or waiting for a retry), by job and slot: what a
-- claim with overlap_skip, the heartbeat and the listing of open runs look for. It
-- replaces {open_idx_old} (without 'retrying'), which drop_runs_open_old drops.
CREATE INDEX IF NOT EXISTS {open_idx} ON {runs} (job, slot)
WHERE status IN ('running', 'handed_over', 'retrying')

-- name: drop_runs_open_old
DROP INDEX IF EXISTS {open_idx_old_q}

-- name: is_store_index
-- Whether the index of a name the store's releases made (spelled as the DROP that drops
-- it names it) exists and is on the store's table: an index of that name on another
-- table (an application's, in the same schema or later in the search_path) is not the
-- store's, and is never dropped. Parameters: the index, the table.
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_index
               WHERE indexrelid = to_regclass(%s::text) AND indrelid = to_regclass(%s::text))

-- name: create_attempts
CREATE TABLE IF NOT EXISTS {attempts} (
    job text NOT NULL,
    slot bigint NOT NULL,
    attempt integer NOT NULL,
    seq bigint NOT NULL,
    instance_id text NOT NULL,
    reason text NOT NULL,
    claimed_ms bigint NOT NULL,
    finished_ms bigint,
    outcome text,
    error text,
    PRIMARY KEY (job, slot, attempt)
)

-- name: create_attempts_seq
CREATE INDEX IF NOT EXISTS {seq_idx} ON {attempts} (job, seq)

-- name: create_attempts_claimed
CREATE INDEX IF NOT EXISTS {claimed_idx} ON {attempts} (claimed_ms, slot, attempt)

-- name: create_attempts_job
CREATE INDEX IF NOT EXISTS {job_idx} ON {attempts} (job, claimed_ms, slot, attempt)

-- name: drop_attempts_finished
-- The upgrade from store code v3: the attempts' index by finish time goes, so that
-- ending an attempt changes no indexed column (a HOT update); trimming by age finds the
-- attempts through their claim time instead (an attempt never finishes before its claim).
DROP INDEX IF EXISTS {fin_idx_q}

-- name: table_columns
-- The columns of one of the store's tables that exists: a table of that name that is
-- not anarchon's lacks the ones the store needs, and is refused before anything changes.
SELECT ARRAY(SELECT attname::text FROM pg_catalog.pg_attribute
             WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped)

-- name: has_takeovers
-- Whether the runs table has the takeovers column (store code v2).
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute
               WHERE attrelid = %s::regclass AND attname = 'takeovers' AND NOT attisdropped)

-- name: add_takeovers
-- Store code v1 to v2: a nullable column without default changes only the catalog.
ALTER TABLE {runs} ADD COLUMN takeovers integer

-- name: write_format
INSERT INTO {meta} (key, value) VALUES ('format', %s::text) ON CONFLICT (key) DO NOTHING

-- name: write_code
-- The store code version, never lowered (an older release may run migrate again).
INSERT INTO {meta} AS m (key, value) VALUES ('code', %s::text)
ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value
WHERE m.value !~ '^[0-9]+$' OR m.value::integer < EXCLUDED.value::integer

-- name: grant_claim
GRANT EXECUTE ON FUNCTION {claim}({claim_arg_types}) TO PUBLIC

-- name: grant_batch
GRANT EXECUTE ON FUNCTION {batch}(text[], bigint[], text[], text[], bigint[], text[],
                                     boolean[], bigint[], boolean[]) TO PUBLIC

-- name: grant_claim_v2
GRANT EXECUTE ON FUNCTION {claim_v2}({claim_arg_types_v2}) TO PUBLIC

-- name: grant_batch_v2
GRANT EXECUTE ON FUNCTION {batch_v2}(text[], bigint[], text[], text[], bigint[], text[],
                                     boolean[], bigint[], bigint[], bigint[], bigint) TO PUBLIC

-- name: grant_finish
GRANT EXECUTE ON FUNCTION {finish}(text, bigint, text, text, text) TO PUBLIC

-- name: grant_claim_v3
GRANT EXECUTE ON FUNCTION {claim_v3}({claim_arg_types_v3}) TO PUBLIC

-- name: grant_batch_v3
GRANT EXECUTE ON FUNCTION {batch_v3}(text[], bigint[], text[], text[], bigint[], text[],
                                     boolean[], bigint[]) TO PUBLIC

-- name: grant_failover
-- Failover detection (issue 21): the function claims and named leases call.
GRANT EXECUTE ON FUNCTION {failover}(bigint) TO PUBLIC

-- name: record_timeline
-- Failover (issue 21): the store's 'failover' row ('<timeline> <epoch> <quiet>', see
-- failover_v<N>.sql), written with the server's timeline and epoch 0 in the transaction
-- that makes (or upgrades) the store, when missing. Left to the first claim, a failover
-- that lost every claim made since (the replica cut off meanwhile) would find no row,
-- record the promoted server's timeline as the store's and detect nothing: attempt 1 of
-- a run would be fenced 1 twice, with both holders live.
INSERT INTO {meta} (key, value)
VALUES ('failover', left(pg_walfile_name(pg_current_wal_lsn()), 8) || ' 0 0')
ON CONFLICT (key) DO NOTHING

-- name: drop_claim_unfenced
-- The claim and batch functions of this code version made by earlier builds of this
-- unreleased version: before they returned the epoch (failover, issue 21: CREATE OR
-- REPLACE cannot change a result type), and before they took p_scheduled (the trimmed
-- slots, issue 18).
DROP FUNCTION IF EXISTS {claim}({claim_arg_types}), {claim}({claim_arg_types_v3})

-- name: drop_batch_unfenced
DROP FUNCTION IF EXISTS {batch}(text[], bigint[], text[], text[], bigint[], text[],
                                boolean[], bigint[]),
                        {batch}(text[], bigint[], text[], text[], bigint[], text[],
                                boolean[], bigint[], boolean[])

-- name: grant_claim_v1
GRANT EXECUTE ON FUNCTION {claim_v1}({claim_arg_types_v2}) TO PUBLIC

-- name: claim
SELECT c_status, c_now, c_attempt, c_reason, c_expires, c_run_status, c_instance, c_epoch
FROM {claim}(%s::text, %s::bigint, %s::text, %s::text, %s::bigint, %s::text,
                %s::boolean, %s::bigint, %s::boolean)

-- name: claim_many
SELECT c_index, c_status, c_now, c_attempt, c_reason, c_expires, c_run_status, c_instance,
       c_epoch
FROM {batch}(%s::text[], %s::bigint[], %s::text[], %s::text[], %s::bigint[], %s::text[],
                %s::boolean[], %s::bigint[], %s::boolean[])

-- name: select_now
SELECT {now}

-- name: register_jobs
WITH j AS (
    INSERT INTO {jobs} AS j (job, first_seen_ms, seq)
    SELECT x.job, {now}, 0 FROM unnest(%s::text[]) AS x(job) ORDER BY x.job
    ON CONFLICT (job) DO UPDATE SET job = EXCLUDED.job
    RETURNING j.job, j.first_seen_ms, j.last_slot, (j.xmax = 0) AS new)
SELECT j.job, j.first_seen_ms, j.last_slot, j.new,
       ARRAY(SELECT r.slot FROM {runs} r
             WHERE r.job = j.job AND r.status IN ('running', 'handed_over', 'retrying')
             ORDER BY r.slot)
FROM j

-- name: heartbeat
-- A run locked by a fenced transaction is skipped, not waited for. Answers the store's
-- now, the tokens held, those renewed, and the cancelled ones with their grace.
WITH u AS (
    SELECT * FROM unnest(%s::text[], %s::bigint[], %s::text[], %s::bigint[])
        AS u(job, slot, token, lease_ms)),
live AS (
    SELECT r.job, r.slot, r.token, u.lease_ms
    FROM {runs} r JOIN u ON r.job = u.job AND r.slot = u.slot AND r.token = u.token
    WHERE r.status = 'running' AND r.expires_ms > {now}),
lockable AS (
    SELECT r.job, r.slot, r.token, l.lease_ms
    FROM {runs} r JOIN live l ON r.job = l.job AND r.slot = l.slot AND r.token = l.token
    FOR NO KEY UPDATE OF r SKIP LOCKED),
-- The update reads only the locked rows (never joins two CTEs, whose row counts the
-- planner cannot estimate: a nested loop over both is quadratic in the leases).
renewed AS (
    UPDATE {runs} r SET expires_ms = {now} + k.lease_ms, heartbeat_ms = {now}
    FROM lockable k
    WHERE r.job = k.job AND r.slot = k.slot AND r.token = k.token AND r.status = 'running'
    RETURNING r.token),
-- cancel(grace=): a run an operator cancelled keeps its holder's token; its expires_ms is
-- the cancel's time (its attempt's finished_ms) plus the grace (operate_v<N>.sql).
cancelled AS (
    SELECT r.token, GREATEST(r.expires_ms - COALESCE(a.finished_ms, {now}), 0) AS grace_ms
    FROM {runs} r JOIN u ON r.job = u.job AND r.slot = u.slot AND r.token = u.token
    LEFT JOIN {attempts} a ON a.job = r.job AND a.slot = r.slot AND a.attempt = r.attempt
    WHERE r.status = 'cancelled' AND r.expires_ms IS NOT NULL)
SELECT {now}, ARRAY(SELECT token FROM live), ARRAY(SELECT token FROM renewed),
       ARRAY(SELECT token FROM cancelled), ARRAY(SELECT grace_ms FROM cancelled)

-- name: finish
-- One call of the finish function (finish_v<N>.sql), whose plans are cached per
-- connection: 1 when the token held the run and ended it, else 0.
SELECT {finish}(%s::text, %s::bigint, %s::text, %s::text, %s::text)

-- name: finish_many
-- Each (job, slot, token) at most once (the backend sends a token's first item only).
WITH u AS (
    SELECT * FROM unnest(%s::text[], %s::bigint[], %s::text[], %s::text[], %s::text[])
        AS u(job, slot, token, outcome, error)),
run AS (
    UPDATE {runs} r SET status = u.outcome, token = NULL, expires_ms = NULL
    FROM u
    WHERE r.job = u.job AND r.slot = u.slot AND r.token = u.token AND r.status = 'running'
    RETURNING u.token, r.job, r.slot, r.attempt, u.outcome, u.error),
att AS (
    UPDATE {attempts} a SET outcome = run.outcome, error = run.error, finished_ms = {now}
    FROM run
    WHERE a.job = run.job AND a.slot = run.slot AND a.attempt = run.attempt
      AND a.outcome IS NULL
    RETURNING 1)
SELECT token FROM run

-- name: retry_later
-- Retries within a run (issue 19, part 1): the fenced end of a failed attempt, as the
-- finish function ends it, leaving the run 'retrying' (no token; expires_ms the retry's
-- due time, on the store's clock) while it had fewer retries than there are delays, else
-- ending the run with the outcome. One row, the retry's number (0: the run ended); none
-- when the token no longer holds the run.
-- Retry counter: the run row's retries (NULL: none yet) counts the retries this
-- statement granted, so trimming history never allows extra ones (memory and Redis keep
-- theirs in the run too); an operator's retry (operate_v<N>.sql) does not count.
-- Parameters: job, slot, token, outcome, error, delays (ms, one per retry allowed).
WITH p AS (
    SELECT %s::text AS job, %s::bigint AS slot, %s::text AS token, %s::text AS outcome,
           %s::text AS error, %s::bigint[] AS delays),
run AS (
    UPDATE {runs} r
    SET status = CASE WHEN COALESCE(r.retries, 0) < cardinality(p.delays) THEN 'retrying'
                      ELSE p.outcome END,
        token = NULL,
        expires_ms = CASE WHEN COALESCE(r.retries, 0) < cardinality(p.delays)
                          THEN {now} + p.delays[COALESCE(r.retries, 0) + 1] END,
        retries = CASE WHEN COALESCE(r.retries, 0) < cardinality(p.delays)
                       THEN COALESCE(r.retries, 0) + 1 ELSE r.retries END
    FROM p
    WHERE r.job = p.job AND r.slot = p.slot AND r.token = p.token AND r.status = 'running'
    RETURNING r.attempt, r.status, r.retries),
att AS (
    UPDATE {attempts} a SET outcome = p.outcome, error = p.error, finished_ms = {now}
    FROM p, run
    WHERE a.job = p.job AND a.slot = p.slot AND a.attempt = run.attempt
      AND a.outcome IS NULL
    RETURNING 1)
SELECT CASE WHEN run.status = 'retrying' THEN run.retries ELSE 0 END FROM run

-- name: hand_over
WITH u AS (
    SELECT * FROM unnest(%s::text[], %s::bigint[], %s::text[]) AS u(job, slot, token)),
run AS (
    UPDATE {runs} r SET status = 'handed_over', token = NULL, expires_ms = {now}
    FROM u
    WHERE r.job = u.job AND r.slot = u.slot AND r.token = u.token AND r.status = 'running'
    RETURNING u.token, r.job, r.slot, r.attempt),
att AS (
    UPDATE {attempts} a SET outcome = 'handed_over', finished_ms = {now}
    FROM run
    WHERE a.job = run.job AND a.slot = run.slot AND a.attempt = run.attempt
      AND a.outcome IS NULL
    RETURNING 1)
SELECT token FROM run

-- name: check
-- Failover (issue 21): n.quiet is the end of the quarantine after a detected promotion
-- (failover_v<N>.sql; NULL before any): a watched run missing before it was lost with the
-- old primary's commits, not deleted. n.moved: the store last wrote on another timeline
-- than the server writes, a promotion no claim has detected yet (NULL on a standby, or
-- without the row): a missing run is lost too, and its claim detects the promotion.
SELECT n.now, r.job, r.slot, r.status, r.attempt, r.expires_ms, r.instance_id, n.quiet,
       n.moved
FROM (SELECT {now} AS now,
             (SELECT split_part(m.value, ' ', 3)::bigint FROM {meta} m
              WHERE m.key = 'failover') AS quiet,
             (SELECT split_part(m.value, ' ', 1)
                     <> CASE WHEN NOT pg_is_in_recovery()
                             THEN left(pg_walfile_name(pg_current_wal_lsn()), 8) END
              FROM {meta} m WHERE m.key = 'failover') AS moved) AS n
LEFT JOIN ({runs} r JOIN unnest(%s::text[], %s::bigint[]) AS u(job, slot)
           ON r.job = u.job AND r.slot = u.slot) ON true

-- name: history_of_job
-- requested_by through to_jsonb: a store of older code, read as it is, has no such column.
SELECT job, slot, attempt, instance_id, reason, claimed_ms, finished_ms, outcome, error,
       to_jsonb(a) ->> 'requested_by'
FROM {attempts} a
WHERE job = %s::text ORDER BY claimed_ms DESC, slot DESC, attempt DESC LIMIT %s::bigint

-- name: history_all
-- requested_by through to_jsonb: a store of older code, read as it is, has no such column.
SELECT job, slot, attempt, instance_id, reason, claimed_ms, finished_ms, outcome, error,
       to_jsonb(a) ->> 'requested_by'
FROM {attempts} a
ORDER BY claimed_ms DESC, slot DESC, attempt DESC LIMIT %s::bigint

-- name: list_jobs
SELECT job FROM {jobs} ORDER BY job

-- name: trim_job
-- One job's history trimmed outside a claim (the ticker's trimming, `anarchon prune`):
-- finished attempts beyond the newest N and those finished more than M ms ago, at most a batch
-- of each, then the finished runs left with no attempt, the newest of whose slots is
-- recorded in the row 'trimmed:<job>' of {meta} (never lowered; see the claim function: a
-- scheduled claim of a slot at or before it starts no run). Parameters: job, keep (N, a
-- huge number for no limit), older_than_ms (M, NULL for none), batch.
-- Never trimmed either: the attempt of a run cancelled with a grace that has not passed
-- (cancel(grace=), operate_v<N>.sql: the run keeps its holder's token, expires_ms the end
-- of the grace), so the holder's heartbeat still finds the run cancelled, with its grace
-- (read from that attempt); the run and its attempt go once the grace has passed (as
-- memory and Redis trim), nor any attempt of an open run (running, handed over, waiting
-- for a retry): the run's recovery log stays until it ends.
-- A workflow run's steps are kept while it goes on (the jobs of its steps, when the job
-- is a step of a workflow recorded in {meta}: see trim_jobs).
-- by size: the attempts at or before the one just beyond the newest N, oldest first (as
-- memory and Redis trim), less those not finished (an open run's: deleting it would
-- leave the run with nothing to trim once it ends), through the attempts' index by
-- (job, seq)
WITH listed AS (
    SELECT split_part(%(job)s::text, '/', 1) || '/' || s.step AS step
    FROM {meta} m CROSS JOIN LATERAL json_array_elements_text(m.value::json) AS s(step)
    WHERE m.key = 'workflow:' || split_part(%(job)s::text, '/', 1)
      AND strpos(%(job)s::text, '/') > 0),
steps AS (
    SELECT l.step FROM listed l WHERE %(job)s::text IN (SELECT k.step FROM listed k)),
by_size AS (
    SELECT a.slot, a.attempt FROM {attempts} a
    WHERE a.job = %(job)s::text AND a.finished_ms IS NOT NULL
      AND a.seq <= (SELECT b.seq FROM {attempts} b WHERE b.job = %(job)s::text
                    ORDER BY b.seq DESC OFFSET %(keep)s::bigint LIMIT 1)
      AND NOT EXISTS (
          SELECT 1 FROM {runs} r
          WHERE r.job = a.job AND r.slot = a.slot
            AND (r.status IN ('running', 'handed_over', 'retrying')
                 OR (r.attempt = a.attempt AND r.status = 'cancelled'
                     AND r.token IS NOT NULL AND r.expires_ms > {now})))
      AND NOT EXISTS (
          SELECT 1 FROM steps w JOIN {runs} r ON r.job = w.step AND r.slot = a.slot
          WHERE r.status IN ('running', 'handed_over', 'retrying'))
    ORDER BY a.seq LIMIT %(batch)s::bigint
    FOR UPDATE SKIP LOCKED),
-- by age: through the attempts' index by claim time (an attempt is claimed before it
-- finishes); the attempts have no index by finish time (none after store code v3)
by_age AS (
    SELECT a.slot, a.attempt FROM {attempts} a
    WHERE a.job = %(job)s::text AND a.claimed_ms < {now} - %(older_than_ms)s::bigint
      AND a.finished_ms < {now} - %(older_than_ms)s::bigint
      AND NOT EXISTS (
          SELECT 1 FROM {runs} r
          WHERE r.job = a.job AND r.slot = a.slot
            AND (r.status IN ('running', 'handed_over', 'retrying')
                 OR (r.attempt = a.attempt AND r.status = 'cancelled'
                     AND r.token IS NOT NULL AND r.expires_ms > {now})))
      AND NOT EXISTS (
          SELECT 1 FROM steps w JOIN {runs} r ON r.job = w.step AND r.slot = a.slot
          WHERE r.status IN ('running', 'handed_over', 'retrying')
             OR EXISTS (SELECT 1 FROM {attempts} e
                        WHERE e.job = r.job AND e.slot = r.slot
                          AND (e.finished_ms IS NULL
                               OR e.finished_ms >= {now} - %(older_than_ms)s::bigint)))
    LIMIT %(batch)s::bigint
    FOR UPDATE SKIP LOCKED),
doomed AS (
    SELECT s.slot, s.attempt FROM by_size s
    UNION
    SELECT t.slot, t.attempt FROM by_age t),
-- the doomed attempts' runs, locked and read as they are now, not as the statement's
-- snapshot saw them: an operator's retry committed meanwhile reopened its run (whose
-- attempts then stay); one being changed now is skipped, its attempts kept this time.
-- Locked FOR UPDATE, as the deletion below locks them, not FOR SHARE: another trimming
-- (of another step of the workflow: its others_settled) could share one and wait, as
-- this one would, to delete a run the other shares (deadlock detected); the runs one
-- locks so are skipped by the other, and their slots' attempts kept this time
settled AS (
    SELECT r.slot FROM {runs} r
    WHERE r.job = %(job)s::text AND r.slot IN (SELECT d.slot FROM doomed d)
      AND r.status NOT IN ('running', 'handed_over', 'retrying')
    FOR UPDATE SKIP LOCKED),
-- the workflow's other steps' runs at the doomed slots, locked and read as they are now
-- too: a slot where one is open now (an operator's retry of a failed step reopened the
-- workflow run meanwhile) or being changed keeps its attempts this time
others AS (
    SELECT r.job, r.slot FROM steps w JOIN {runs} r ON r.job = w.step
    WHERE w.step <> %(job)s::text AND r.slot IN (SELECT d.slot FROM doomed d)),
others_settled AS (
    SELECT r.job, r.slot FROM {runs} r
    WHERE (r.job, r.slot) IN (SELECT o.job, o.slot FROM others o)
      AND r.status NOT IN ('running', 'handed_over', 'retrying')
    FOR SHARE SKIP LOCKED),
gone AS (
    DELETE FROM {attempts} a USING doomed d
    WHERE a.job = %(job)s::text AND a.slot = d.slot AND a.attempt = d.attempt
      AND (a.slot IN (SELECT s.slot FROM settled s)
           OR NOT EXISTS (SELECT 1 FROM {runs} r WHERE r.job = a.job AND r.slot = a.slot))
      AND NOT EXISTS (
          SELECT 1 FROM others o
          WHERE o.slot = a.slot
            AND (o.job, o.slot) NOT IN (SELECT x.job, x.slot FROM others_settled x))
    RETURNING a.slot, a.attempt),
runs_gone AS (
    DELETE FROM {runs} r
    WHERE r.job = %(job)s::text AND r.slot IN (SELECT g.slot FROM gone g)
      AND r.status NOT IN ('running', 'handed_over', 'retrying')
      AND NOT EXISTS (
          SELECT 1 FROM {attempts} a
          WHERE a.job = r.job AND a.slot = r.slot
            AND (a.slot, a.attempt) NOT IN (SELECT g.slot, g.attempt FROM gone g))
    RETURNING r.slot),
marked AS (
    INSERT INTO {meta} AS m (key, value)
    SELECT 'trimmed:' || %(job)s::text, max(d.slot)::text FROM runs_gone d
    HAVING count(*) > 0
    ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value
    WHERE m.value::bigint < EXCLUDED.value::bigint
    RETURNING 1)
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM runs_gone)

-- name: trim_jobs
-- The histories of many jobs trimmed in one statement, each job as trim_job trims it (at
-- most a batch by size and a batch by age per job, its newest trimmed slot recorded; the
-- 'trimmed:' rows are written in the order of the jobs, so two trimmings never wait for
-- each other's rows in opposite orders; the attempt of a run cancelled with a grace that
-- has not passed is kept, as trim_job keeps it). Parameters: jobs, keep (N, a huge number
-- for no limit), older_than_ms (M, NULL for none), batch. One row per job that lost
-- attempts.
-- A workflow run's steps are trimmed together, once it has ended: the steps of a job that
-- is a step of a workflow recorded in {meta} ('workflow:<name>', register_workflows)
-- keep every attempt of a slot where one of the workflow's steps has a run still open
-- (by size and by age), or, by age, an attempt that ended less than M ms ago (the ttl
-- counts from the workflow run's end). A few primary-key reads per attempt trimmed.
WITH j AS (
    SELECT DISTINCT x.job FROM unnest(%(jobs)s::text[]) AS x(job)),
listed AS (
    SELECT j.job, split_part(j.job, '/', 1) || '/' || s.step AS step
    FROM j JOIN {meta} m ON m.key = 'workflow:' || split_part(j.job, '/', 1)
    CROSS JOIN LATERAL json_array_elements_text(m.value::json) AS s(step)
    WHERE strpos(j.job, '/') > 0),
steps AS (
    SELECT l.job, l.step FROM listed l
    WHERE EXISTS (SELECT 1 FROM listed k WHERE k.job = l.job AND k.step = l.job)),
by_size AS (
    SELECT s.job, s.slot, s.attempt FROM j CROSS JOIN LATERAL (
        SELECT a.job, a.slot, a.attempt FROM {attempts} a
        WHERE a.job = j.job AND a.finished_ms IS NOT NULL
          AND a.seq <= (SELECT b.seq FROM {attempts} b WHERE b.job = j.job
                        ORDER BY b.seq DESC OFFSET %(keep)s::bigint LIMIT 1)
          AND NOT EXISTS (
              SELECT 1 FROM {runs} r
              WHERE r.job = a.job AND r.slot = a.slot
                AND (r.status IN ('running', 'handed_over', 'retrying')
                     OR (r.attempt = a.attempt AND r.status = 'cancelled'
                         AND r.token IS NOT NULL AND r.expires_ms > {now})))
          AND NOT EXISTS (
              SELECT 1 FROM steps w JOIN {runs} r ON r.job = w.step AND r.slot = a.slot
              WHERE w.job = a.job AND r.status IN ('running', 'handed_over', 'retrying'))
        ORDER BY a.seq LIMIT %(batch)s::bigint
        FOR UPDATE SKIP LOCKED) s),
by_age AS (
    SELECT s.job, s.slot, s.attempt FROM j CROSS JOIN LATERAL (
        SELECT a.job, a.slot, a.attempt FROM {attempts} a
        WHERE a.job = j.job AND a.claimed_ms < {now} - %(older_than_ms)s::bigint
          AND a.finished_ms < {now} - %(older_than_ms)s::bigint
          AND NOT EXISTS (
              SELECT 1 FROM {runs} r
              WHERE r.job = a.job AND r.slot = a.slot
                AND (r.status IN ('running', 'handed_over', 'retrying')
                     OR (r.attempt = a.attempt AND r.status = 'cancelled'
                         AND r.token IS NOT NULL AND r.expires_ms > {now})))
          AND NOT EXISTS (
              SELECT 1 FROM steps w JOIN {runs} r ON r.job = w.step AND r.slot = a.slot
              WHERE w.job = a.job
                AND (r.status IN ('running', 'handed_over', 'retrying')
                     OR EXISTS (SELECT 1 FROM {attempts} e
                                WHERE e.job = r.job AND e.slot = r.slot
                                  AND (e.finished_ms IS NULL
                                       OR e.finished_ms >= {now} - %(older_than_ms)s::bigint))))
        LIMIT %(batch)s::bigint
        FOR UPDATE SKIP LOCKED) s),
doomed AS (
    SELECT d.job, d.slot, d.attempt FROM by_size d
    UNION
    SELECT t.job, t.slot, t.attempt FROM by_age t),
-- the doomed attempts' runs as they are now (see trim_job)
settled AS (
    SELECT r.job, r.slot FROM {runs} r
    WHERE (r.job, r.slot) IN (SELECT d.job, d.slot FROM doomed d)
      AND r.status NOT IN ('running', 'handed_over', 'retrying')
    FOR UPDATE SKIP LOCKED),
-- the workflow's other steps' runs at the doomed slots as they are now (see trim_job)
others AS (
    SELECT w.job AS trimmed, r.job, r.slot FROM steps w JOIN {runs} r ON r.job = w.step
    WHERE w.step <> w.job AND (w.job, r.slot) IN (SELECT d.job, d.slot FROM doomed d)),
others_settled AS (
    SELECT r.job, r.slot FROM {runs} r
    WHERE (r.job, r.slot) IN (SELECT o.job, o.slot FROM others o)
      AND r.status NOT IN ('running', 'handed_over', 'retrying')
    FOR SHARE SKIP LOCKED),
gone AS (
    DELETE FROM {attempts} a USING doomed d
    WHERE a.job = d.job AND a.slot = d.slot AND a.attempt = d.attempt
      AND ((a.job, a.slot) IN (SELECT s.job, s.slot FROM settled s)
           OR NOT EXISTS (SELECT 1 FROM {runs} r WHERE r.job = a.job AND r.slot = a.slot))
      AND NOT EXISTS (
          SELECT 1 FROM others o
          WHERE o.trimmed = a.job AND o.slot = a.slot
            AND (o.job, o.slot) NOT IN (SELECT x.job, x.slot FROM others_settled x))
    RETURNING a.job, a.slot, a.attempt),
runs_gone AS (
    DELETE FROM {runs} r
    WHERE (r.job, r.slot) IN (SELECT g.job, g.slot FROM gone g)
      AND r.status NOT IN ('running', 'handed_over', 'retrying')
      AND NOT EXISTS (
          SELECT 1 FROM {attempts} a
          WHERE a.job = r.job AND a.slot = r.slot
            -- not correlated, so hashed once (per run, a scan of every deleted attempt)
            AND (a.job, a.slot, a.attempt) NOT IN (
                SELECT g.job, g.slot, g.attempt FROM gone g))
    RETURNING r.job, r.slot),
marked AS (
    INSERT INTO {meta} AS m (key, value)
    SELECT 'trimmed:' || d.job, max(d.slot)::text FROM runs_gone d
    GROUP BY d.job ORDER BY d.job
    ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value
    WHERE m.value::bigint < EXCLUDED.value::bigint
    RETURNING 1)
SELECT g.job, count(*) FROM gone g GROUP BY g.job

-- name: maintenance_due
-- Win this period's maintenance (history trimming) for one instance across the fleet:
-- the row 'maintenance' holds "<end of the period, ms> <instance>"; it is added when
-- missing (stores made before it) and taken over once its period has ended. ON CONFLICT
-- re-checks the condition on the row's latest version, so two callers never both win.
-- Parameters: the period (ms), the instance.
INSERT INTO {meta} AS m (key, value)
VALUES ('maintenance', ({now} + %s::bigint)::text || ' ' || %s::text)
ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value
WHERE CASE WHEN m.value ~ '^[0-9]+ ' THEN split_part(m.value, ' ', 1)::bigint ELSE 0 END
      <= {now}
RETURNING 1

-- name: members
-- Renew one instance's membership of the fleet and list the live members, in one
-- statement: the row 'member:<instance>' holds the end of its membership (ms, the server's
-- clock), upserted; member rows that ended more than %(keep_ms)s ms ago are deleted,
-- by one caller at a time (a transaction-scoped advisory try-lock: the others skip the
-- deletion this time), skipping rows another caller holds locked, and never the caller's
-- own row. With two deleters at once, each could lock the other's old row before
-- upserting its own (the CTEs run in no set order), and deadlock. The statement's snapshot does not see its own upsert,
-- so the caller is added to the list explicitly. Other rows of the table (format, code,
-- maintenance, workflow:...) are never touched: member rows are found with left(), and the
-- cast of their value is guarded by CASE (a WHERE clause does not short-circuit).
-- Parameters: instance, ttl_ms, keep_ms.
WITH renewed AS (
    INSERT INTO {meta} AS m (key, value)
    VALUES ('member:' || %(instance)s::text, ({now} + %(ttl_ms)s::bigint)::text)
    ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value),
cleaner AS (
    SELECT pg_try_advisory_xact_lock(hashtext('anarchon members'), hashtext('{meta}')) AS won),
doomed AS (
    SELECT m.key FROM {meta} m
    WHERE (SELECT won FROM cleaner)
      AND left(m.key, 7) = 'member:' AND m.key <> 'member:' || %(instance)s::text
      AND CASE WHEN m.value ~ '^[0-9]+$' AND length(m.value) < 19
               THEN m.value::bigint ELSE 0 END < {now} - %(keep_ms)s::bigint
    FOR UPDATE SKIP LOCKED),
gone AS (
    DELETE FROM {meta} m USING doomed d WHERE m.key = d.key)
SELECT %(instance)s::text
UNION
SELECT substr(m.key, 8) FROM {meta} m
WHERE left(m.key, 7) = 'member:'
  AND CASE WHEN m.value ~ '^[0-9]+$' AND length(m.value) < 19
           THEN m.value::bigint ELSE 0 END > {now}

-- name: leave
-- End one instance's membership of the fleet now (a graceful stop): delete its row.
-- Parameters: the instance id.
DELETE FROM {meta} WHERE key = 'member:' || %s::text RETURNING 1

-- name: write_workflows
-- Each workflow's ordered step names, as a JSON array under the key 'workflow:<name>';
-- a name given no steps ('[]') is no longer a workflow: its row is deleted.
WITH w AS (
    SELECT 'workflow:' || n.name AS key, n.steps
    FROM unnest(%s::text[], %s::text[]) AS n(name, steps)
), gone AS (
    DELETE FROM {meta} WHERE key IN (SELECT key FROM w WHERE steps = '[]')
)
INSERT INTO {meta} (key, value)
SELECT key, steps FROM w WHERE steps <> '[]'
ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value
WHERE {meta}.value IS DISTINCT FROM EXCLUDED.value

-- name: read_workflows
SELECT substr(key, 10), value FROM {meta} WHERE left(key, 9) = 'workflow:' ORDER BY key

-- name: list_runs
SELECT job, slot, status, attempt, instance_id, expires_ms FROM {runs}
WHERE (%(job)s::text IS NULL OR job = %(job)s::text)
  AND (NOT %(open_only)s::boolean OR status IN ('running', 'handed_over', 'retrying'))
ORDER BY slot DESC, job LIMIT %(limit)s::bigint

-- name: get_checkpoint
SELECT checkpoint FROM {runs} WHERE job = %s::text AND slot = %s::bigint

-- name: set_checkpoint
UPDATE {runs} SET checkpoint = %s::text
WHERE job = %s::text AND slot = %s::bigint AND token = %s::text AND status = 'running'
RETURNING 1

-- name: lock_held_run
SELECT attempt FROM {runs}
WHERE job = %s::text AND slot = %s::bigint AND token = %s::text AND status = 'running'
FOR UPDATE

-- name: extend_held_run
-- At the end of a fenced transaction that does not complete its run, before the commit:
-- the lease runs from now (the transaction's lock kept backups out, not the clock), so
-- a transaction about as long as the lease does not cost the run.
UPDATE {runs} SET expires_ms = GREATEST(expires_ms, {now} + %s::bigint), heartbeat_ms = {now}
WHERE job = %s::text AND slot = %s::bigint AND token = %s::text AND status = 'running'

-- name: write_schedules
-- Each job's schedule spec (JSON) under the key 'schedule:<job>'.
INSERT INTO {meta} (key, value)
SELECT 'schedule:' || s.name, s.spec FROM unnest(%s::text[], %s::text[]) AS s(name, spec)
ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value
WHERE {meta}.value IS DISTINCT FROM EXCLUDED.value

-- name: read_schedules
SELECT substr(key, 10), value FROM {meta} WHERE left(key, 9) = 'schedule:' ORDER BY key
