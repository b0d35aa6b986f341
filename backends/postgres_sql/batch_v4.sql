-- Many claims in one statement (store code v4): the claim function of claim_v4.sql run
-- for each element of the arrays, in order, in the statement's one transaction, so a
-- later claim sees what an earlier one wrote and each answer is what the claim alone
-- would have answered. One row per claim, c_index being its position (1-based).
--
-- The caller sorts the claims by job and slot, so that two batches lock the rows of their
-- jobs in the same order. A claim's lock wait that runs out fails the whole statement,
-- which writes nothing; the caller then claims one at a time.
--
-- The text has no percent sign and no braces other than the str.format placeholders.
CREATE OR REPLACE FUNCTION {batch}(
    p_job text[], p_slot bigint[], p_instance text[], p_token text[], p_lease_ms bigint[],
    p_reason text[], p_overlap_skip boolean[], p_max_attempts bigint[],
    p_scheduled boolean[])
RETURNS TABLE(c_index integer, c_status text, c_now bigint, c_attempt integer,
              c_reason text, c_expires bigint, c_run_status text, c_instance text,
              c_epoch bigint)
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
AS $anarchon$
DECLARE
    i integer;
BEGIN
    FOR i IN 1 .. coalesce(array_length(p_job, 1), 0) LOOP
        RETURN QUERY SELECT i, c.* FROM {claim}(
            p_job[i], p_slot[i], p_instance[i], p_token[i], p_lease_ms[i], p_reason[i],
            p_overlap_skip[i], p_max_attempts[i], p_scheduled[i]) AS c;
    END LOOP;
END
$anarchon$
