-- The claim function's name in store code v3 (<table>_claim_v3), replaced on upgrade by
-- a call of the current function ({claim}): instances of that release still running during
-- a rolling upgrade then claim with the current logic. Same signature and result as the
-- v3 function, whose full text is kept in tests/fixtures/store_v3.sql.
CREATE OR REPLACE FUNCTION {claim_v3}(
    {claim_args_v3},
    OUT c_status text, OUT c_now bigint, OUT c_attempt integer, OUT c_reason text,
    OUT c_expires bigint, OUT c_run_status text, OUT c_instance text)
LANGUAGE sql VOLATILE SECURITY INVOKER
AS $anarchon$
SELECT c_status, c_now, c_attempt, c_reason, c_expires, c_run_status, c_instance
FROM {claim}(p_job, p_slot, p_instance, p_token, p_lease_ms, p_reason,
                         p_overlap_skip, p_max_attempts, NULL)
$anarchon$
