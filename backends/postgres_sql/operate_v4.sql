-- Operations (lease_core/operations.py) as one PL/pgSQL function (store code v4): a
-- trigger, pause, resume, retry or cancel is one statement, made atomically under the
-- job row's lock (the lock every claim of the job takes first; a retry or a cancel takes
-- its run row's lock before it, see below), or refused changing
-- nothing. o_refused is NULL when made, else 'unknown_job', 'no_run' or 'conflict';
-- o_slot the run's slot (a trigger's new one); o_status the run's status before.
--
-- - trigger: a new run at the store's now (never on a whole second, where schedules put
--   their slots; the next free millisecond), 'handed_over'
--   with attempt 0, so that its first claim (by any instance declaring the job) is
--   attempt 1, with reason 'manual' (runs.queued) and requested_by p_by.
-- - retry: a failed, timed_out or escalated run becomes 'handed_over' again, its next
--   claim with reason 'retry'.
-- - cancel: a running, handed-over or retrying run ends 'cancelled' (its open attempt too, error
--   'cancelled by <p_by>'; a run nobody holds gets an attempt of its own, instance
--   p_by, so the cancel is in its history); a claim then finds it finished (no takeover).
--   cancel(grace=): the run keeps its holder's token and its expires_ms becomes
--   now + p_grace_ms (now: the cancelled attempt's finished_ms), so the holder's
--   heartbeat answers "cancelled" with the grace (queries.sql, heartbeat).
-- - pause / resume: set or clear the job row's paused_by; a claim of a new slot of a
--   paused job records it 'skipped' (claim_v4.sql). A resume appends '; resumed by
--   <p_by>' to the error of the slots the pause skipped.
--
-- The text has no percent sign and no braces other than the str.format placeholders.
CREATE OR REPLACE FUNCTION {operate}(
    p_kind text, p_job text, p_slot bigint, p_by text, p_grace_ms bigint,
    OUT o_refused text, OUT o_slot bigint, OUT o_status text)
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
AS $anarchon$
DECLARE
    v_now bigint;
    v_status text;
    v_attempt integer;
    v_seq bigint;
    v_found boolean := false;
BEGIN
    IF p_kind IN ('retry', 'cancel') THEN
        -- The run row first, the job row after: a run inside its fenced transaction
        -- (ctx.transaction(), fenced.py's lock_held_run) holds its row until it commits,
        -- and waiting for it while holding the job row held back every claim of the job
        -- meanwhile. Claims, heartbeats and finishes holding a job row skip locked run
        -- rows, so they never wait for this one. (A retry or cancel racing both a resume
        -- or takeover of the job and a trim deleting this run can still close a cycle
        -- through an attempt row: PostgreSQL then fails one of them, which is retried.)
        SELECT r.status, r.attempt INTO v_status, v_attempt
          FROM {runs} r WHERE r.job = p_job AND r.slot = p_slot FOR UPDATE;
        v_found := FOUND;
    END IF;
    PERFORM 1 FROM {jobs} j WHERE j.job = p_job FOR UPDATE;
    IF NOT FOUND THEN
        o_refused := 'unknown_job';
        RETURN;
    END IF;
    v_now := {now};
    IF p_kind = 'resume' THEN
        -- Resume leaves a record: each slot the pause skipped ('job paused by <who>')
        -- gets '; resumed by <p_by>' in its attempt's error (history, recovery log).
        UPDATE {attempts} a SET error = a.error || '; resumed by ' || p_by
        FROM {jobs} j
        WHERE j.job = p_job AND j.paused_by IS NOT NULL AND a.job = p_job
          AND a.outcome = 'skipped' AND a.error = 'job paused by ' || j.paused_by;
    END IF;
    IF p_kind IN ('pause', 'resume') THEN
        -- A pause of a paused job (it would hide who paused it) and a resume of a job
        -- not paused are refused. A resume raises the job's last_slot to now: the slots
        -- due while paused are never caught up, even those no instance was up to skip
        -- (a starting scheduler catches up from last_slot).
        UPDATE {jobs} SET paused_by = CASE WHEN p_kind = 'pause' THEN p_by END,
                          last_slot = CASE WHEN p_kind = 'pause' THEN last_slot
                                           ELSE GREATEST(COALESCE(last_slot, v_now), v_now) END
        WHERE job = p_job AND (paused_by IS NULL) = (p_kind = 'pause');  -- operate body 3
        IF NOT FOUND THEN
            o_refused := 'conflict';
        END IF;
        RETURN;
    END IF;
    IF p_kind = 'trigger' THEN
        -- Off the whole second, where schedules put their slots; then the next free ms.
        o_slot := v_now + CASE WHEN mod(v_now, 1000) = 0 THEN 1 ELSE 0 END;
        WHILE EXISTS (SELECT 1 FROM {runs} r WHERE r.job = p_job AND r.slot = o_slot) LOOP
            o_slot := o_slot + 1;
        END LOOP;
        INSERT INTO {runs} (job, slot, status, attempt, token, instance_id, expires_ms,
                            takeovers, queued, queued_by)
        VALUES (p_job, o_slot, 'handed_over', 0, NULL, p_by, v_now, 0, 'manual', p_by);
        -- The job's last_slot stays: it is where a starting scheduler catches up from,
        -- and a triggered run is no slot of the schedule (its claim raises it).
        RETURN;
    END IF;
    o_slot := p_slot;
    IF NOT v_found THEN
        o_refused := 'no_run';
        RETURN;
    END IF;
    o_status := v_status;
    IF p_kind = 'retry' THEN
        IF v_status NOT IN ('failed', 'timed_out', 'escalated') THEN
            o_refused := 'conflict';
            RETURN;
        END IF;
        -- The retried run starts anew: max_attempts counts its takeovers from now, and
        -- its job's retry= grants its retries again.
        UPDATE {runs} SET status = 'handed_over', token = NULL, expires_ms = v_now,
                          queued = 'retry', queued_by = p_by, takeovers = 0,
                          retries = NULL
        WHERE job = p_job AND slot = p_slot;
        RETURN;
    END IF;
    IF v_status NOT IN ('running', 'handed_over', 'retrying') THEN
        o_refused := 'conflict';
        RETURN;
    END IF;
    UPDATE {attempts} SET outcome = 'cancelled', error = 'cancelled by ' || p_by,
                          finished_ms = v_now
    WHERE job = p_job AND slot = p_slot AND attempt = v_attempt AND outcome IS NULL;
    IF v_status IN ('handed_over', 'retrying') THEN
        -- Nobody holds the run: the cancel is recorded as the attempt it prevents (who
        -- cancelled it, and the reason and requester its claim would have had), with the
        -- job's next history sequence, as a claim takes it.
        UPDATE {jobs} SET seq = seq + 1 WHERE job = p_job RETURNING seq INTO v_seq;
        INSERT INTO {attempts} (job, slot, attempt, seq, instance_id, reason, claimed_ms,
                                claimed_at, finished_ms, outcome, error, requested_by)
        SELECT p_job, p_slot, v_attempt + 1, v_seq, p_by,
               CASE WHEN v_status = 'retrying' THEN 'retry'
                    ELSE COALESCE(r.queued, 'hand-over') END,
               v_now, to_timestamp(v_now / 1000.0), v_now, 'cancelled',
               'cancelled by ' || p_by, r.queued_by
          FROM {runs} r WHERE r.job = p_job AND r.slot = p_slot;
        UPDATE {runs} SET attempt = v_attempt + 1, instance_id = p_by
        WHERE job = p_job AND slot = p_slot;
    END IF;
    -- cancel(grace=): the token stays, expires_ms is now + the holder's grace.
    UPDATE {runs} SET status = 'cancelled', expires_ms = v_now + GREATEST(p_grace_ms, 0),
                      queued = NULL, queued_by = NULL
    WHERE job = p_job AND slot = p_slot;
END
$anarchon$
