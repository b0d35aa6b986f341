-- Failover detection (issue 21, store code v4): the store's epoch and quarantine, kept in
-- the {meta} row 'failover' as '<timeline> <epoch> <quiet>'.
--
-- <timeline> is the first 8 hex digits of the name of the WAL file the server writes: the
-- timeline, which a promotion (pg_promote, pg_ctl promote, Patroni) raises. A claim (the
-- claim function of claim_v4.sql, so every batch too) and a named lease's acquisition
-- (leases.sql) compare it with the one they find; when it differs, the server was
-- promoted since the store last wrote, and acknowledged commits of the old primary may
-- be lost. This function then records, once (under the row's lock):
--
-- - <epoch>: the store's clock at detection (ms; greater than any earlier epoch), which
--   every later claim returns, so fence_of(epoch, attempt) grows across the failover even
--   where the store numbers an attempt again, and every named-lease token it issues from
--   now on is at least epoch << 20 (times 1048576);
-- - <quiet>: the end of the quarantine, detection + the longest lease that may have been
--   live (the caller's lease, or the longest time left on a lease the store still has);
--   a claim also waits the epoch plus its own lease. Until then no attempt starts and no
--   named lease is taken;
-- - and it ends every lease the store still shows live (expires_ms, a named lease's
--   expiry: now), so every holder learns at its next heartbeat that its lease is gone.
--
-- A missing row (a store created before this code) is written with epoch 0. Only
-- pg_walfile_name(pg_current_wal_lsn()) is called, which any role may run (the app's
-- user needs no more than its table privileges), and nothing keeps session state
-- (PgBouncer in transaction mode). It returns the epoch and the quarantine's end.
--
-- The text has no percent sign and no braces other than the str.format placeholders.
CREATE OR REPLACE FUNCTION {failover}(p_lease_ms bigint, OUT f_epoch bigint,
                                      OUT f_quiet bigint)
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
AS $anarchon$
DECLARE
    v_timeline text;
    v_value text;
    v_now bigint;
    v_left bigint;
BEGIN
    v_timeline := left(pg_walfile_name(pg_current_wal_lsn()), 8);
    SELECT m.value INTO v_value FROM {meta} m WHERE m.key = 'failover';
    IF NOT FOUND THEN
        INSERT INTO {meta} (key, value) VALUES ('failover', v_timeline || ' 0 0')
        ON CONFLICT (key) DO NOTHING;
        IF FOUND THEN
            f_epoch := 0; f_quiet := 0;
            RETURN;
        END IF;
    END IF;
    IF v_value IS NULL OR split_part(v_value, ' ', 1) <> v_timeline THEN
        v_value := set_config('lock_timeout', GREATEST(LEAST(p_lease_ms / 8, 4000), 10)::text,
                              true);
        SELECT m.value INTO v_value FROM {meta} m WHERE m.key = 'failover' FOR UPDATE;
    END IF;
    f_epoch := split_part(v_value, ' ', 2)::bigint;
    f_quiet := split_part(v_value, ' ', 3)::bigint;
    IF split_part(v_value, ' ', 1) = v_timeline THEN
        RETURN;  -- found, or detected by the claim we waited for
    END IF;
    v_now := {now};
    SELECT max(r.expires_ms) - v_now INTO v_left FROM {runs} r
     WHERE r.status = 'running' AND r.expires_ms > v_now;
    SELECT GREATEST(v_left, max(CASE WHEN left(m.key, 6) = 'lease:'
                                     THEN split_part(m.value, ' ', 2)::bigint END) - v_now)
      INTO v_left FROM {meta} m WHERE left(m.key, 6) = 'lease:';
    f_epoch := GREATEST(v_now, f_epoch + 1);
    f_quiet := v_now + GREATEST(p_lease_ms, v_left, 0);
    UPDATE {meta} SET value = v_timeline || ' ' || f_epoch || ' ' || f_quiet
     WHERE key = 'failover';
    UPDATE {runs} SET expires_ms = v_now WHERE status = 'running' AND expires_ms > v_now;
    UPDATE {meta} m
       SET value = split_part(m.value, ' ', 1) || ' ' || v_now::text || ' '
                   || substr(m.value, length(split_part(m.value, ' ', 1))
                                      + length(split_part(m.value, ' ', 2)) + 3)
     WHERE left(m.key, 6) = 'lease:'
       AND CASE WHEN left(m.key, 6) = 'lease:' THEN split_part(m.value, ' ', 2)::bigint
                ELSE 0 END > v_now;
END
$anarchon$
