-- The claim of lease_core.abc as one PL/pgSQL function (store code v4, the body of v3's),
-- so that a claim is one statement: one round trip in autocommit on every adapter. Its version is in its
-- name: a changed body or signature is a new file and a new name (claim_v5.sql, ...),
-- which `anarchon migrate` (or start() by a privileged user) creates next to the old one.
--
-- It is VOLATILE and runs in READ COMMITTED, so every statement takes a fresh snapshot:
-- after waiting for the job row's lock, the read of the run sees what the previous
-- claimer committed.
--
-- - Fast path: a run that is finished, or running with a live lease, is reported from a
--   plain read, without any lock or write (backups standing by write nothing). A claim
--   whose token already holds the run (sent again after a lost reply) answers 'won'.
-- - Every later lock wait is bounded on the server (lock_timeout, transaction-local, an
--   eighth of the lease and at most 4 s), so a claim its client gave up on fails on the
--   server too, writing nothing. A claim waits for two locks at most (the job row, or
--   its insertion then the row): a quarter of the lease, within the half lease a
--   scheduler waits for a claim, and 8 s, within pg8000's default 10 s socket timeout.
-- - The job row is locked (SELECT ... FOR UPDATE; inserted when missing, race-safe
--   through ON CONFLICT DO NOTHING), which serialises the claims of one job.
-- - The run row is locked with SKIP LOCKED: a run locked by a fenced transaction (or a
--   write in flight) is answered 'running' at once, never waited for, so a frozen
--   ctx.transaction() holds the job's lock for no other claim.
-- - max_attempts counts the first attempt and the takeovers (runs.takeovers), never
--   hand-overs. For a run written by store code v1 (takeovers NULL) the count comes from
--   its attempts recorded with reason 'takeover'.
-- - The job row gets a new version only when last_slot grows or an attempt is written
--   (which takes the next seq, the order trimming keeps), in one UPDATE at most.
-- - Retries within a run (issue 19, part 1): a 'retrying' run (a failed attempt left
--   retries, see retry_later in queries.sql) stands by like a live lease until its
--   expires_ms, the retry's due time; then the next attempt takes it with reason 'retry'
--   (neither counted by max_attempts nor escalated).
-- - It trims no history (v2 did, after every attempt it wrote): the scheduler's ticker
--   trims every job in bounded batches (the trim_job statement), off the claim path.
-- - Trimmed slots (issue 18): trimming records the newest slot whose run it deleted, in
--   the row 'trimmed:<job>' of {meta}. A new run of a slot at or before it, for a job
--   the schedule starts (p_scheduled: not a later workflow step) and a scheduled or
--   catch-up claim, is answered 'finished' with no run (attempt 0, c_run_status NULL),
--   writing nothing: the slot ran and was trimmed, or its turn passed while newer runs
--   ran and were trimmed. The row is read under the job's lock, after the run was found
--   missing, so a trimming that committed before that read is seen; only for a slot at
--   or before the job's last_slot (a slot newer than every claim was never trimmed), so
--   an on-time claim, the common case, reads nothing more.
--
-- - Failover (issue 21): past the fast path, the timeline the server writes is compared with
--   the store's (the 'failover' row of {meta}; failover_v4.sql detects a promotion and
--   records the new epoch). During the quarantine after a detected promotion a claim
--   answers 'running' with no run (attempt 0, c_run_status NULL, c_expires the end of
--   the quarantine) and writes nothing, as the Redis store does after a data loss.
--   Every answer past the fast path carries the store's epoch (c_epoch, 0 before any
--   loss), the epoch an attempt won now is numbered in; the fast path (which starts no
--   attempt) answers c_epoch NULL, except a repeated claim's 'won'. Its cost: one
--   primary-key read of {meta}, on the paths that lock (a claim that wins or takes over
--   costs about 2 percent more server time; a backup standing by nothing).
--
-- The text has no percent sign and no braces other than the str.format placeholders.
CREATE OR REPLACE FUNCTION {claim}(
    {claim_args},
    OUT c_status text, OUT c_now bigint, OUT c_attempt integer, OUT c_reason text,
    OUT c_expires bigint, OUT c_run_status text, OUT c_instance text, OUT c_epoch bigint)
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
AS $anarchon$
DECLARE
    v_now bigint;
    v_found boolean;
    v_status text;
    v_attempt integer;
    v_instance text;
    v_expires bigint;
    v_token text;
    v_takeovers integer;
    v_last bigint;
    v_seq bigint;
    v_row_seq bigint;
    v_reason text;
    v_set text;
    v_paused text;     -- operations: who paused the job
    v_queued text;     -- operations: the reason a trigger or retry queued
    v_queued_by text;  -- operations: who asked for it
    v_failover text;   -- failover: the 'failover' row of meta
    v_quiet bigint;    -- failover: the end of the quarantine
    v_trimmed text;    -- trimmed slots: the 'trimmed:<job>' row of meta
BEGIN
    SELECT r.status, r.attempt, r.instance_id, r.expires_ms, r.token
      INTO v_status, v_attempt, v_instance, v_expires, v_token
      FROM {runs} r WHERE r.job = p_job AND r.slot = p_slot;
    v_found := FOUND;
    v_now := {now};
    IF v_found AND v_status = 'running' AND v_token = p_token THEN
        -- the same claim sent again after its reply was lost: answer as the first did
        SELECT a.reason INTO c_reason FROM {attempts} a
        WHERE a.job = p_job AND a.slot = p_slot AND a.attempt = v_attempt;
        c_status := 'won'; c_now := v_now; c_attempt := v_attempt; c_expires := v_expires;
        c_run_status := v_status; c_instance := v_instance;
        c_reason := COALESCE(c_reason, p_reason);
        -- failover (issue 21): the store's epoch, which this attempt was numbered in
        -- unless a promotion was detected since (its lease then ended at the detection)
        SELECT split_part(m.value, ' ', 2)::bigint INTO c_epoch FROM {meta} m
         WHERE m.key = 'failover';
        RETURN;
    END IF;
    IF v_found AND (v_status NOT IN ('running', 'handed_over', 'retrying')
                    OR (v_status IN ('running', 'retrying') AND v_expires > v_now)) THEN
        c_status := CASE WHEN v_status IN ('running', 'retrying') THEN 'running'
                         ELSE 'finished' END;
        c_now := v_now; c_attempt := v_attempt; c_expires := v_expires;
        c_run_status := v_status; c_instance := v_instance;
        RETURN;
    END IF;

    -- Failover (issue 21): past the fast path (which starts no attempt), detect a
    -- promotion, answer 'running' with no run during the quarantine, and carry the
    -- epoch (see failover_v4.sql).
    SELECT m.value INTO v_failover FROM {meta} m WHERE m.key = 'failover';
    IF v_failover IS NOT NULL
       AND split_part(v_failover, ' ', 1) = left(pg_walfile_name(pg_current_wal_lsn()), 8) THEN
        c_epoch := split_part(v_failover, ' ', 2)::bigint;
    ELSE
        SELECT f.f_epoch, f.f_quiet INTO c_epoch, v_quiet FROM {failover}(p_lease_ms) f;
        v_failover := '';
    END IF;
    IF c_epoch > 0 THEN
        v_now := {now};
        IF v_quiet IS NULL THEN
            v_quiet := split_part(v_failover, ' ', 3)::bigint;
        END IF;
        v_quiet := GREATEST(v_quiet, c_epoch + p_lease_ms);
        IF v_now < v_quiet THEN
            c_status := 'running'; c_now := v_now; c_attempt := 0; c_expires := v_quiet;
            RETURN;
        END IF;
    END IF;

    -- an assignment, which PL/pgSQL evaluates as a simple expression (PERFORM runs a query)
    v_set := set_config('lock_timeout', GREATEST(LEAST(p_lease_ms / 8, 4000), 10)::text, true);

    SELECT j.last_slot, j.seq, j.paused_by INTO v_last, v_seq, v_paused
      FROM {jobs} j WHERE j.job = p_job FOR UPDATE;
    IF FOUND THEN
        v_row_seq := v_seq;
    ELSE
        INSERT INTO {jobs} AS j (job, first_seen_ms, last_slot, seq)
        VALUES (p_job, {now}, p_slot, 1)
        ON CONFLICT (job) DO NOTHING;
        IF FOUND THEN
            v_last := p_slot; v_seq := 0; v_row_seq := 1;
        ELSE
            SELECT j.last_slot, j.seq, j.paused_by INTO v_last, v_seq, v_paused
              FROM {jobs} j WHERE j.job = p_job FOR UPDATE;
            v_row_seq := v_seq;
        END IF;
    END IF;

    v_now := {now};
    c_now := v_now;
    -- Under the job's lock, a plain read first: a run missing now stays missing (only a
    -- holder of that lock inserts one), and a finished one stays finished. Only an open
    -- run is locked, with SKIP LOCKED, and judged on the values read under its lock.
    SELECT r.status, r.attempt, r.instance_id, r.expires_ms, r.takeovers
      INTO v_status, v_attempt, v_instance, v_expires, v_takeovers
      FROM {runs} r WHERE r.job = p_job AND r.slot = p_slot;
    v_found := FOUND;
    IF v_found AND v_status IN ('running', 'handed_over', 'retrying') THEN
        SELECT r.status, r.attempt, r.instance_id, r.expires_ms, r.takeovers
          INTO v_status, v_attempt, v_instance, v_expires, v_takeovers
          FROM {runs} r WHERE r.job = p_job AND r.slot = p_slot FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            -- Locked by a fenced transaction or a write in flight (a locked run is running
            -- elsewhere), or gone: a plain read again tells which (INTO left NULLs).
            SELECT r.status, r.attempt, r.instance_id, r.expires_ms
              INTO v_status, v_attempt, v_instance, v_expires
              FROM {runs} r WHERE r.job = p_job AND r.slot = p_slot;
            v_found := FOUND;
            IF v_found THEN
                c_status := CASE WHEN v_status IN ('running', 'handed_over', 'retrying')
                                 THEN 'running' ELSE 'finished' END;
                c_attempt := v_attempt; c_expires := v_expires;
                c_run_status := v_status; c_instance := v_instance;
                RETURN;
            END IF;
        END IF;
    END IF;

    IF NOT v_found AND p_scheduled AND p_slot <= v_last
       AND p_reason IN ('scheduled', 'catch-up') THEN
        SELECT m.value INTO v_trimmed FROM {meta} m WHERE m.key = 'trimmed:' || p_job;
        IF v_trimmed IS NOT NULL AND p_slot <= v_trimmed::bigint THEN
            c_status := 'finished'; c_attempt := 0;
            RETURN;
        END IF;
    END IF;

    IF NOT v_found THEN
        v_seq := v_seq + 1;
        -- Operations: a paused job's new slot is recorded skipped, never run nor caught
        -- up (a trigger's run exists already, so it is never a new one here).
        IF v_paused IS NOT NULL AND p_reason IN ('scheduled', 'catch-up') THEN
            INSERT INTO {runs} (job, slot, status, attempt, token, instance_id, expires_ms,
                                takeovers)
            VALUES (p_job, p_slot, 'skipped', 1, NULL, p_instance, NULL, 0);
            INSERT INTO {attempts} (job, slot, attempt, seq, instance_id, reason, claimed_ms,
                                    claimed_at, finished_ms, outcome, error)
            VALUES (p_job, p_slot, 1, v_seq, p_instance, p_reason, v_now,
                    to_timestamp(v_now / 1000.0), v_now, 'skipped',
                    'job paused by ' || v_paused);
            c_status := 'skipped'; c_attempt := 1; c_run_status := 'skipped';
            c_instance := p_instance;
        -- Overlap: skipped while an earlier run holds a live lease or waits for its
        -- retry (a retry is the same run going on: issue 19). Through the open runs'
        -- partial index ({open_idx}), whose predicate the status list implies.
        ELSIF p_overlap_skip AND EXISTS (
                SELECT 1 FROM {runs} o
                WHERE o.job = p_job AND o.slot < p_slot AND o.status IN ('running', 'retrying')
                  AND (o.status = 'retrying' OR o.expires_ms > v_now)) THEN
            INSERT INTO {runs} (job, slot, status, attempt, token, instance_id, expires_ms,
                                takeovers)
            VALUES (p_job, p_slot, 'skipped', 1, NULL, p_instance, NULL, 0);
            INSERT INTO {attempts} (job, slot, attempt, seq, instance_id, reason, claimed_ms,
                                    claimed_at, finished_ms, outcome, error)
            VALUES (p_job, p_slot, 1, v_seq, p_instance, p_reason, v_now,
                    to_timestamp(v_now / 1000.0), v_now, 'skipped',
                    CASE WHEN EXISTS (
                             SELECT 1 FROM {runs} o
                             WHERE o.job = p_job AND o.slot < p_slot AND o.status = 'running'
                               AND o.expires_ms > v_now)
                         THEN 'an earlier run of the job still holds its lease'
                         ELSE 'an earlier run of the job waits for its retry' END);
            c_status := 'skipped'; c_attempt := 1; c_run_status := 'skipped';
            c_instance := p_instance;
        ELSE
            c_expires := v_now + p_lease_ms;
            INSERT INTO {runs} (job, slot, status, attempt, token, instance_id, expires_ms,
                                takeovers)
            VALUES (p_job, p_slot, 'running', 1, p_token, p_instance, c_expires, 0);
            INSERT INTO {attempts} (job, slot, attempt, seq, instance_id, reason, claimed_ms,
                                    claimed_at)  -- claimed_at written
            VALUES (p_job, p_slot, 1, v_seq, p_instance, p_reason, v_now,
                    to_timestamp(v_now / 1000.0));
            c_status := 'won'; c_attempt := 1; c_reason := p_reason;
            c_run_status := 'running'; c_instance := p_instance;
        END IF;
    ELSIF v_status NOT IN ('running', 'handed_over', 'retrying') THEN
        c_status := 'finished'; c_attempt := v_attempt; c_expires := v_expires;
        c_run_status := v_status; c_instance := v_instance;
    ELSIF v_status IN ('running', 'retrying') AND v_expires > v_now THEN
        c_status := 'running'; c_attempt := v_attempt; c_expires := v_expires;
        c_run_status := v_status; c_instance := v_instance;
    ELSE
        IF v_takeovers IS NULL THEN
            -- A run written by store code v1: count the takeovers its history recorded.
            SELECT count(*) INTO v_takeovers FROM {attempts} a
             WHERE a.job = p_job AND a.slot = p_slot AND a.attempt > 1
               AND a.reason = 'takeover';
        END IF;
        IF v_status = 'running' AND p_max_attempts IS NOT NULL
           AND 1 + v_takeovers >= p_max_attempts THEN
            UPDATE {attempts}
            SET outcome = 'escalated', finished_ms = v_now,
                error = 'lease lost on attempt ' || v_attempt || ' of max_attempts='
                        || p_max_attempts || ' (hand-overs not counted); escalated'
            WHERE job = p_job AND slot = p_slot AND attempt = v_attempt AND outcome IS NULL;
            UPDATE {runs} SET status = 'escalated', token = NULL, expires_ms = NULL,
                              takeovers = v_takeovers
            WHERE job = p_job AND slot = p_slot;
            c_status := 'escalated'; c_attempt := v_attempt; c_run_status := 'escalated';
            c_instance := v_instance;
        ELSE
            IF v_status = 'handed_over' THEN
                v_reason := 'hand-over';
                -- Operations: a triggered or retried run's attempt says why (manual,
                -- retry) and who asked (see operate_v4.sql).
                SELECT r.queued, r.queued_by INTO v_queued, v_queued_by
                  FROM {runs} r WHERE r.job = p_job AND r.slot = p_slot;
                v_reason := COALESCE(v_queued, v_reason);
            ELSIF v_status = 'retrying' THEN
                v_reason := 'retry';  -- retries within a run (issue 19, part 1)
            ELSE
                v_reason := 'takeover';
                v_takeovers := v_takeovers + 1;
                UPDATE {attempts}
                SET outcome = 'lost', error = 'lease expired without renewal',
                    finished_ms = v_now
                WHERE job = p_job AND slot = p_slot AND attempt = v_attempt
                  AND outcome IS NULL;
            END IF;
            v_seq := v_seq + 1;
            c_expires := v_now + p_lease_ms;
            UPDATE {runs}
            SET status = 'running', attempt = v_attempt + 1, token = p_token,
                instance_id = p_instance, expires_ms = c_expires, takeovers = v_takeovers
            WHERE job = p_job AND slot = p_slot;
            INSERT INTO {attempts} (job, slot, attempt, seq, instance_id, reason, claimed_ms,
                                    claimed_at)
            VALUES (p_job, p_slot, v_attempt + 1, v_seq, p_instance, v_reason, v_now,
                    to_timestamp(v_now / 1000.0));
            IF v_queued IS NOT NULL THEN
                -- Operations: the queued reason is used once.
                UPDATE {runs} SET queued = NULL, queued_by = NULL
                WHERE job = p_job AND slot = p_slot;
                UPDATE {attempts} SET requested_by = v_queued_by
                WHERE job = p_job AND slot = p_slot AND attempt = v_attempt + 1;
            END IF;
            c_status := 'won'; c_attempt := v_attempt + 1; c_reason := v_reason;
            c_run_status := 'running'; c_instance := p_instance;
        END IF;
    END IF;

    IF v_seq > v_row_seq OR v_last IS NULL OR p_slot > v_last THEN
        UPDATE {jobs} SET last_slot = GREATEST(last_slot, p_slot), seq = GREATEST(seq, v_seq)
        WHERE job = p_job;
    END IF;
END
$anarchon$
