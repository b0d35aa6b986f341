-- The statements of operations (backends/postgres/operations.py), each under a
-- `-- name: <name>` header, filled as queries.sql is. Kept apart from queries.sql so that
-- the feature's statements are in one place.

-- name: has_operations
-- Whether the store has the columns of operations (store code v4 with operations).
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute
               WHERE attrelid = %s::regclass AND attname = 'requested_by'
                 AND NOT attisdropped)

-- name: add_operations_runs
-- queued: the reason of the next attempt of a triggered or retried run ('manual',
-- 'retry'), queued_by who asked; heartbeat_ms: the lease's last renewal (the status
-- API's heartbeat_at). Nullable without default: catalog only.
ALTER TABLE {runs} ADD COLUMN IF NOT EXISTS queued text,
                   ADD COLUMN IF NOT EXISTS queued_by text,
                   ADD COLUMN IF NOT EXISTS heartbeat_ms bigint

-- name: has_retry_counter
-- Whether the runs table has the retry counter (retries within a run, store code v4).
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute
               WHERE attrelid = %s::regclass AND attname = 'retries' AND NOT attisdropped)

-- name: add_retry_counter
-- The retries retry_later granted the run (queries.sql); nullable without default:
-- catalog only.
ALTER TABLE {runs} ADD COLUMN IF NOT EXISTS retries integer

-- name: add_operations_jobs
ALTER TABLE {jobs} ADD COLUMN IF NOT EXISTS paused_by text

-- name: add_operations_attempts
-- requested_by: who asked for the attempt (trigger, retry). claimed_at: the claim time as
-- a timestamp, for hand-written history queries (seed 004's), written with claimed_ms by
-- the functions that insert attempts (claim_v4.sql, operate_v4.sql). Both nullable
-- without default: catalog only, so an upgrade does not rewrite the attempts table while
-- it holds the runs table (a stored generated column did, about 1.5 s per million
-- attempts). The attempts of earlier releases get claimed_at afterwards, in batches
-- (fill_claimed_at).
ALTER TABLE {attempts} ADD COLUMN IF NOT EXISTS requested_by text,
    ADD COLUMN IF NOT EXISTS claimed_at timestamptz

-- name: claimed_at_generated
-- Whether claimed_at is the generated column an earlier build of this unreleased store
-- code made (the functions now write it). attgenerated through to_jsonb: servers before
-- PostgreSQL 12 have no such column (nor generated columns).
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a
               WHERE a.attrelid = %s::regclass AND a.attname = 'claimed_at'
                 AND COALESCE(to_jsonb(a) ->> 'attgenerated', '') <> ''
                 AND NOT a.attisdropped)

-- name: drop_claimed_at_expression
-- A generated claimed_at becomes a plain column keeping its values (catalog only).
ALTER TABLE {attempts} ALTER COLUMN claimed_at DROP EXPRESSION IF EXISTS

-- name: mark_claimed_at_fill
-- Written by the upgrade that adds claimed_at to a store of older code: the attempts it
-- already holds are filled in after the upgrade's commit (fill_claimed_at), by `anarchon
-- migrate` at once, else a few batches at each maintenance; the mark keeps where the fill
-- got to (fill_moved) and goes at its end (claimed_at_filled).
INSERT INTO {meta} (key, value) VALUES ('fill', 'claimed_at') ON CONFLICT (key) DO NOTHING

-- name: fill_claimed_at
-- One batch of the fill: the next attempts in primary-key order after the given key get
-- claimed_at, each batch its own short transaction that locks only its rows. Answers the
-- batch's last key and its size (no row, or fewer than asked: done). Parameters: the
-- last key (job, slot, attempt), the batch size.
WITH b AS (
    SELECT a.job, a.slot, a.attempt FROM {attempts} a
    WHERE (a.job, a.slot, a.attempt) > (%s::text, %s::bigint, %s::integer)
    ORDER BY a.job, a.slot, a.attempt
    LIMIT %s::bigint
), filled AS (
    UPDATE {attempts} a SET claimed_at = to_timestamp(a.claimed_ms / 1000.0)
    FROM b WHERE a.job = b.job AND a.slot = b.slot AND a.attempt = b.attempt
      AND a.claimed_at IS NULL
)
SELECT b.job, b.slot, b.attempt, (SELECT count(*) FROM b) FROM b
ORDER BY b.job DESC, b.slot DESC, b.attempt DESC LIMIT 1

-- name: fill_position
-- The fill's mark: 'claimed_at', then 'claimed_at:' and the JSON key it got to.
SELECT value FROM {meta} WHERE key = 'fill'

-- name: fill_moved
-- LIKE, not starts_with (PostgreSQL 11 and later only).
UPDATE {meta} SET value = %s::text WHERE key = 'fill' AND value LIKE 'claimed_at%%'

-- name: claimed_at_filled
DELETE FROM {meta} WHERE key = 'fill' AND value LIKE 'claimed_at%%'

-- name: grant_operate
GRANT EXECUTE ON FUNCTION {operate}(text, text, bigint, text, bigint) TO PUBLIC

-- name: operate
SELECT o_refused, o_slot, o_status
FROM {operate}(%s::text, %s::text, %s::bigint, %s::text, %s::bigint)

-- name: paused
-- Through to_jsonb: a store of older code, read as it is, has no paused_by column.
SELECT p.job, p.by FROM (SELECT j.job, to_jsonb(j) ->> 'paused_by' AS by FROM {jobs} j) p
WHERE p.by IS NOT NULL ORDER BY p.job

-- name: queued
-- Triggered and retried runs not claimed yet (not plain hand-overs, which the backups
-- watching them claim), through the runs' partial index of open runs.
SELECT r.job, r.slot FROM {runs} r
WHERE r.status = 'handed_over' AND r.queued IS NOT NULL AND r.job = ANY(%s::text[])
ORDER BY r.job, r.slot
LIMIT 1000

-- name: heartbeats
-- The last renewal of each run, for the status API; through to_jsonb, as a store of
-- older code, read as it is, has no heartbeat_ms column.
SELECT r.job, r.slot, to_jsonb(r) ->> 'heartbeat_ms'
FROM {runs} r JOIN unnest(%s::text[], %s::bigint[]) AS u(job, slot)
  ON r.job = u.job AND r.slot = u.slot
