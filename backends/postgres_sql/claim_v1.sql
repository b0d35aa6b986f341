-- The claim function's name in store code v1 (<table>_claim, anarchon 0.1.0), replaced
-- on upgrade by a call of the current function: instances of that release still running
-- during a rolling upgrade then claim with the current logic and keep runs.takeovers.
-- Same signature and result as claim_v1 and claim_v2; the history arguments are ignored.
--
-- The answer is in 0.1.0's words: that release reads it into its own enums, and a value
-- it does not know raised ValueError in its claim (after a won claim, the run was then
-- left unattended until its lease expired, and taken over as a lost attempt). So a run
-- waiting for a retry is 'running' (it stands by like a live lease until the retry is
-- due), a cancelled run 'failed' (finished), the attempt a retry or a trigger starts
-- 'hand-over' (the store records 'retry' or 'manual'), and the quarantine after a
-- failover, which answers no run, 'running'. A store whose <table>_claim an earlier
-- build made (passing the answer on as it is) gets this one at start (BODY_MARKS).
CREATE OR REPLACE FUNCTION {claim_v1}(
    {claim_args_v2},
    OUT c_status text, OUT c_now bigint, OUT c_attempt integer, OUT c_reason text,
    OUT c_expires bigint, OUT c_run_status text, OUT c_instance text)
LANGUAGE sql VOLATILE SECURITY INVOKER
AS $anarchon$
-- answered in the words of 0.1.0 (BODY_MARKS)
SELECT c_status, c_now, c_attempt,
       CASE WHEN c_reason IN ('retry', 'manual') THEN 'hand-over' ELSE c_reason END,
       c_expires,
       CASE WHEN c_run_status = 'retrying' THEN 'running'
            WHEN c_run_status = 'cancelled' THEN 'failed'
            WHEN c_run_status IS NULL AND c_status = 'running' THEN 'running'
            ELSE c_run_status END,
       c_instance
FROM {claim}(p_job, p_slot, p_instance, p_token, p_lease_ms, p_reason,
                         p_overlap_skip, p_max_attempts, NULL)
$anarchon$
