-- The batched claim's name in store code v2 (<table>_batch_v2), replaced on upgrade by a
-- call of the current one ({batch}), like claim_v2.sql: its history arguments are ignored.
CREATE OR REPLACE FUNCTION {batch_v2}(
    p_job text[], p_slot bigint[], p_instance text[], p_token text[], p_lease_ms bigint[],
    p_reason text[], p_overlap_skip boolean[], p_max_attempts bigint[],
    p_history_size bigint[], p_history_ttl_ms bigint[], p_trim_batch bigint)
RETURNS TABLE(c_index integer, c_status text, c_now bigint, c_attempt integer,
              c_reason text, c_expires bigint, c_run_status text, c_instance text)
LANGUAGE sql VOLATILE SECURITY INVOKER
AS $anarchon$
SELECT c_index, c_status, c_now, c_attempt, c_reason, c_expires, c_run_status, c_instance
FROM {batch}(p_job, p_slot, p_instance, p_token, p_lease_ms, p_reason,
                         p_overlap_skip, p_max_attempts, NULL)
$anarchon$
