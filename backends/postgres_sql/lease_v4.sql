-- Named leases (lease_core.Lease; backends/postgres/leases.py) as one PL/pgSQL function
-- (store code v4): an acquire, a renewal or a release is one short statement,
-- `SELECT * FROM {lease}(...)`, whose plans PostgreSQL keeps per connection (the
-- statements of an ad hoc text were parsed and planned at every call: about two thirds
-- of their server time). It keeps no session state, so PgBouncer in transaction mode
-- works as before.
--
-- A lease is a row of {meta} (no table of its own): key 'lease:<name>', value
-- '<token> <expires_ms> <holder>' (the holder is everything after the second space; ''
-- once released). Only 'lease:' rows are read or written here; every time is the
-- server's clock_timestamp(), read once per call (o_now). The CASE in the WHERE of an
-- UPDATE keeps the cast off rows other than leases (WHERE does not short-circuit).
--
-- p_op 'acquire' (p_name, p_holder, p_ttl_ms): take the name when it is free (no row,
--   released, or expired) with the next token (after a failover, at least the epoch's
--   first token: failover_v4.sql), unless a failover quarantine is running; renew it with
--   the same token when this holder holds it live; otherwise change nothing. ON CONFLICT re-checks the condition
--   on the row's latest version, so two callers never both take it. o_held says whether
--   the caller holds it now; o_token, o_expires and o_holder describe the current hold
--   (token 0, holder NULL for a name never held).
-- p_op 'renew' (p_name, p_token, p_ttl_ms): set the live hold of the token to end at
--   now + ttl; o_held false (and o_expires NULL) when the token no longer holds it live.
-- p_op 'release' (p_name, p_token): free the name now if the token holds it live,
--   keeping the token; o_held says whether it did.
--
-- The text has no percent sign and no braces other than the str.format placeholders.
CREATE OR REPLACE FUNCTION {lease}(
    p_op text, p_name text, p_holder text, p_token text, p_ttl_ms bigint,
    OUT o_held boolean, OUT o_token bigint, OUT o_expires bigint, OUT o_now bigint,
    OUT o_holder text)
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
AS $anarchon$
DECLARE
    v_key text := 'lease:' || p_name;
    v_value text;
    v_epoch bigint;
    v_quiet bigint;
BEGIN
    o_now := {now};
    IF p_op = 'acquire' THEN
        -- Failover (issue 21): {failover} (failover_v4.sql) detects a promotion. After
        -- one, a new token is at least epoch << 20 (fence_of in lease_core), and nothing
        -- is taken until the quarantine is over: the epoch plus this ttl, or the longest
        -- lease then live.
        -- pgcost (issue 19): the check's common case inline, as the claim does: the
        -- 'failover' row read here and the timeline compared in a simple expression;
        -- {failover} is called only when the row is missing or names another timeline.
        SELECT m.value INTO v_value FROM {meta} m WHERE m.key = 'failover';
        IF v_value IS NOT NULL
           AND split_part(v_value, ' ', 1) = left(pg_walfile_name(pg_current_wal_lsn()), 8)
        THEN
            v_epoch := split_part(v_value, ' ', 2)::bigint;
            v_quiet := CASE WHEN v_epoch > 0
                            THEN GREATEST(split_part(v_value, ' ', 3)::bigint,
                                          v_epoch + p_ttl_ms) END;
        ELSE
            SELECT fo.f_epoch,
                   CASE WHEN fo.f_epoch > 0
                        THEN GREATEST(fo.f_quiet, fo.f_epoch + p_ttl_ms) END
              INTO v_epoch, v_quiet
              FROM {failover}(p_ttl_ms) fo;
        END IF;
        v_value := NULL;
        IF v_quiet IS NULL OR v_quiet <= o_now THEN
            INSERT INTO {meta} AS m (key, value)
            VALUES (v_key, GREATEST(1, v_epoch * 1048576)::text || ' '
                           || (o_now + p_ttl_ms)::text || ' ' || p_holder)
            ON CONFLICT (key) DO UPDATE
            SET value = CASE WHEN split_part(m.value, ' ', 2)::bigint > o_now
                             THEN split_part(m.value, ' ', 1)::bigint
                             ELSE GREATEST(split_part(m.value, ' ', 1)::bigint + 1,
                                           split_part(EXCLUDED.value, ' ', 1)::bigint)
                        END::text
                        || ' ' || substr(EXCLUDED.value,
                                         length(split_part(EXCLUDED.value, ' ', 1)) + 2)
            WHERE split_part(m.value, ' ', 2)::bigint <= o_now
               OR substr(m.value, length(split_part(m.value, ' ', 1))
                                  + length(split_part(m.value, ' ', 2)) + 3) = p_holder
            RETURNING m.value INTO v_value;
        END IF;
        o_held := v_value IS NOT NULL;
        IF NOT o_held THEN
            SELECT m.value INTO v_value FROM {meta} m WHERE m.key = v_key;
        END IF;
        IF v_value IS NULL THEN  -- never held (and not taken: quarantined)
            o_token := 0;
            o_expires := 0;
        ELSE
            o_token := split_part(v_value, ' ', 1)::bigint;
            o_expires := split_part(v_value, ' ', 2)::bigint;
            o_holder := NULLIF(substr(v_value, length(split_part(v_value, ' ', 1))
                                               + length(split_part(v_value, ' ', 2)) + 3),
                               '');
        END IF;
        IF NOT o_held AND v_quiet IS NOT NULL THEN  -- quarantined: free no earlier
            o_expires := GREATEST(o_expires, v_quiet);
        END IF;
        RETURN;
    END IF;
    IF p_op = 'renew' THEN
        UPDATE {meta} AS m
        SET value = split_part(m.value, ' ', 1) || ' ' || (o_now + p_ttl_ms)::text || ' '
                    || substr(m.value, length(split_part(m.value, ' ', 1))
                                       + length(split_part(m.value, ' ', 2)) + 3)
        WHERE m.key = v_key
          AND split_part(m.value, ' ', 1) = p_token
          AND CASE WHEN left(m.key, 6) = 'lease:' THEN split_part(m.value, ' ', 2)::bigint
                   ELSE 0 END > o_now;
        o_held := FOUND;
        o_expires := CASE WHEN o_held THEN o_now + p_ttl_ms END;
        RETURN;
    END IF;
    IF p_op = 'release' THEN
        UPDATE {meta} AS m SET value = split_part(m.value, ' ', 1) || ' 0 '
        WHERE m.key = v_key
          AND split_part(m.value, ' ', 1) = p_token
          AND CASE WHEN left(m.key, 6) = 'lease:' THEN split_part(m.value, ' ', 2)::bigint
                   ELSE 0 END > o_now;
        o_held := FOUND;
        RETURN;
    END IF;
    RAISE EXCEPTION USING MESSAGE = 'unknown lease operation ' || p_op, ERRCODE = '22023';
END;
$anarchon$
