"""The Redis backend: every mutation is one Lua script, and lease time is Redis's ``TIME``.

Where the code lives, in this package: :mod:`~backends.redis.backend` (the backend,
:class:`RedisBackend`, made of the parts below), :mod:`~backends.redis.core` (options,
connection, key names, one round trip), :mod:`~backends.redis.claims`,
:mod:`~backends.redis.leases` (renewals, finishes, hand-overs, checks, checkpoints),
:mod:`~backends.redis.records` (history, runs, jobs, workflows, trimming),
:mod:`~backends.redis.scripts` (the Lua scripts) and :mod:`~backends.redis.replies`
(reading replies). Every public name is imported from here.

The scripts live in ``backends/redis_lua/*.lua`` (each prefixed with ``_prelude.lua``),
are registered with the driver (``register_script``) and run with ``EVALSHA``; a
``NOSCRIPT`` reply (after ``SCRIPT FLUSH`` or a restart) loads the script and retries (see
:mod:`adapters.redis`). A claim or a finish is one script call (a claim adds ``SADD`` to
the jobs set, in the same round trip, the first time this process claims its job); a lone
command is sent without a pipeline.
Batched calls (claim_many, finish_many, heartbeat, hand-over, check, register) send one
non-transactional pipeline: one round trip, and valid on a Cluster because each command
touches one slot (the Cluster client groups them by slot). On a server that is not a
Cluster, ``claim_many.lua`` and ``finish_many.lua`` make up to ``SCRIPT_BATCH`` claims or
finishes of any jobs per script call. A heartbeat sends one script
call per job, renewing all of that job's leases (they share the job's hash tag).

Key layout, for ``prefix`` ``P`` and job ``J``; ``E`` is ``J`` percent-encoded
(:func:`urllib.parse.quote` with no safe characters), so no job name can put a ``{``,
``}`` or ``/`` into a key's hash tag. Every key of one job shares the hash tag ``P/E``
and so one Cluster slot, and each script touches only the keys of one job:

===========================  ======  =====================================================
key                          type    content
===========================  ======  =====================================================
``{P}:meta``                 hash    ``format`` (store format), ``created``
``{P}:jobs``                 set     job names, for ``history(job=None)``
``{P}:maintenance``          string  the instance trimming history this period (expires)
``{P}:members``              zset    the fleet's members: instance id by the end of its
                                     membership (ms); ended ones are deleted an hour on
``{P/E}:job``                hash    ``first_seen``, ``last_slot``, ``seq`` (attempt count),
                                     ``sid`` (marker of the job's data), ``lost`` and
                                     ``quiet`` (when a data loss was found, and the end
                                     of its quarantine; ms), ``rid`` and ``ep`` (the
                                     server's replication id, recorded with each new
                                     epoch, and the epoch; ms)
``{P/E}:run:<slot>``         hash    ``st`` status, ``att`` attempt, ``tok`` token, ``inst``
                                     instance, ``exp`` expiry (ms; ``tok`` and ``exp`` are
                                     ``''`` once the run ended), ``cp`` checkpoint JSON,
                                     ``n`` attempts still in the history, ``tk``
                                     takeovers; the current attempt's record: ``r``
                                     reason, ``c`` claimed, ``o`` outcome, ``e`` error,
                                     ``f`` finished (ms); ``h<attempt>`` the JSON record
                                     of each earlier attempt
``{P/E}:open``               zset    slots of runs ``running`` or ``handed_over``
``{P/E}:hist``               zset    attempt ids ``<slot>:<attempt>`` by insertion order
``{P/E}:att``                hash    attempt id -> JSON record (store format 1 only: read,
                                     never written by format 2)
``{P/E}:done``               zset    finished attempt ids by finish time (for the TTL)
``{P/E}:orphan``             set     slots whose attempts were all trimmed
``{P/E}:hold``               set     a workflow step's slots whose workflow run went on
                                     (or ended within the ttl) at the last trimming
                                     (not counted in its batches)
===========================  ======  =====================================================

Store format 2 (:data:`STORE_FORMAT`) keeps the attempt records in the run hashes, so a
claim that wins a new run is 8 commands inside its script (``TIME``, ``HMGET`` of the job
and of the run, ``ZRANGEBYSCORE`` of the open runs for the overlap check, ``HSET`` of the
run, ``ZADD`` open, ``HSET`` of the job, ``ZADD`` history) and a finish 5 (``TIME``,
``HMGET`` and ``HSET`` of the run, ``ZREM`` open, ``ZADD`` done). Format 1 kept them in
``{P/E}:att``; the scripts read both, and opening a format-1 store marks it format 2.

History is trimmed by :meth:`RedisBackend.prune` (``trim.lua``), which the scheduler's
ticker calls for every job (``history_size`` newest, and ``history_ttl``), never by a
claim; finished runs with no attempt left are deleted, so a job's keys stay bounded.
Open runs are never deleted. A workflow run's steps are kept until it has ended: their
keys are in other Cluster slots than the job's, so a job named like a step is trimmed in
three steps (listed by ``trim.lua``, its workflow's runs read by ``held.lua``, deleted
by ``trim.lua``), see :meth:`RedisBackend.prune_many`.

``wait_replicas=N`` sends ``WAIT N timeout`` in the same round trip after a claim, a
heartbeat, a finish (single or batched), a retry, a checkpoint, an operation, and a named
lease's acquire or renewal. When fewer replicas acknowledge a call that wrote, the claim
does **not** count as won, the heartbeat is not counted as renewed, the finish is not
taken as done, the named lease is not held: each raises
:class:`~lease_core.errors.BackendUnavailable`. The unacknowledged write stays in the
primary; the runs an unacknowledged claim won are handed over at once (best-effort, as
:meth:`RedisBackend.hand_over`: not counted toward ``max_attempts``), so a backup takes
them over without waiting for the lease to expire, and an unacknowledged named lease is
released at once (see :mod:`~backends.redis.named`). Only a call that wrote is checked:
a finish sent again after one that raised finds its run already ended, writes nothing
and answers ``False`` (the token lost its run) without a ``WAIT``, so it does not tell
whether the replicas have the first one by then. ``wait_replicas`` is refused on a
Cluster (:class:`~lease_core.errors.ConfigurationError`, at construction for a Cluster
client, else at start): ``WAIT`` names no key, so the Cluster client would send it to a
node that made none of the writes.

Fences (issue 21): every claim reply carries the job's epoch as ``ClaimResult.epoch``:
the later of ``lost`` (below) and ``ep``, set when the job is new to the server (its
first registration or claim there gives it a marker: ``ep`` = now), and when an attempt
won on a server whose replication id differs from the one the job hash recorded at its last win
(``rid``; a promoted replica, a restarted server; the id is recorded with every new
epoch, from the job's first registration or claim on, and a job with an epoch but no id
counts as moved). An attempt numbered again after a
failover so has a fence (:func:`lease_core.fence_of`) above every earlier one. On a
promoted server (one with a ``master_replid2``) that win does not take effect: the job is
quarantined (``quiet``, below) for the longest lease known (at least the claim's own),
since a holder whose claim or renewals the failover lost may still run until its next
heartbeat; a plain restart starts the epoch only. A claim
also finds a loss when the job's history sequence (``seq``) is below the highest one the
caller saw. Named leases: see :mod:`~backends.redis.named`. The epochs are the servers'
clocks, so fencing across a failover assumes the servers' clocks agree: a promoted
server whose clock is behind the start of the last epoch starts the new epoch lower,
below fences handed out before the failover.

Data loss. Data survives a server restart only as far as the server persists it (RDB or
AOF), and a failover to a lagging replica loses the newest writes. The first
registration or claim of a job writes a random marker into the job's hash (``sid``),
and every registration and claim returns it; the backend remembers it per job (from the
registration at start, so a backup that never won the job knows it too) and sends it
with its next claim of the job, with the
longest lease it has claimed or renewed. A claim that finds the marker missing or
different knows the job's data was lost, and the script writes, atomically, a new marker,
the loss time ``lost`` (now, unless recorded already) and a quarantine ``quiet`` = ``lost``
+ that longest lease (raised by later callers that know a longer one, never lowered).
Until ``quiet`` every claim of the job answers ``RUNNING`` with no run (``run_status``
``None``, ``expires_ms`` = ``quiet``) and writes nothing: the scheduler claims again at
its next tick. By then every lease that may have been live at the loss has expired, and
its holder has learnt at a heartbeat that its lease is gone. :meth:`RedisBackend.check`
reads the markers too: a watched run missing from a job whose marker is gone or changed,
or whose quarantine is not over, or whose ``rid`` is not the server's (``moved.lua``: a
promoted replica or a restarted server, before any claim there found the move), was
lost, not deleted (``CheckResult.lost``), and the scheduler claims it again. The
marker lives with the job's keys, so on a Cluster the loss of one shard is found for
exactly the jobs on it.
A process that started after the loss (it never registered the job before it) cannot
tell a lost job from a new one: until a process that did claims it, such a fresh
process may win attempt 1 of a run whose old holder has not yet learnt of the loss.
"""

from __future__ import annotations

from lease_core._packages import require_own

require_own("adapters")  # before importing from it: a foreign one may shadow it

from .backend import RedisBackend
from .core import RedisStore
from .scripts import HEARTBEAT_BATCH, SCRIPT_BATCH, SCRIPTS, STORE_FORMAT, Script

__all__ = ["HEARTBEAT_BATCH", "SCRIPTS", "SCRIPT_BATCH", "STORE_FORMAT", "RedisBackend",
           "RedisStore", "Script"]
