-- The finish of lease_core.abc as one PL/pgSQL function (store code v4): the fenced end
-- of an attempt, 1 when this token held the run (and ended it), 0 otherwise. Its two
-- updates are planned once per connection (PL/pgSQL caches their plans), where the same
-- work sent as a statement was planned on every call: no prepared statements are used,
-- so that pools and PgBouncer in transaction mode work.
--
-- - Fenced: the run is updated only while this token holds it ('running'); a stale token
--   changes nothing and gets 0.
-- - The run's status and its attempt's outcome are the same value, p_outcome; the attempt
--   is ended only when it is still open (never overwriting an outcome).
-- - No index of the attempts covers outcome, error or finished_ms (store code v4), so the
--   attempt's update can be a HOT update (no new index entries, less WAL).
--
-- The text has no percent sign and no braces other than the str.format placeholders.
CREATE OR REPLACE FUNCTION {finish}(
    p_job text, p_slot bigint, p_token text, p_outcome text, p_error text)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
AS $anarchon$
DECLARE
    v_attempt integer;
BEGIN
    UPDATE {runs} SET status = p_outcome, token = NULL, expires_ms = NULL
    WHERE job = p_job AND slot = p_slot AND token = p_token AND status = 'running'
    RETURNING attempt INTO v_attempt;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    UPDATE {attempts} SET outcome = p_outcome, error = p_error, finished_ms = {now}
    WHERE job = p_job AND slot = p_slot AND attempt = v_attempt AND outcome IS NULL;
    RETURN 1;
END
$anarchon$
