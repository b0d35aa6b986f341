"""The chaos suite: real worker processes, real stores, injected faults, then an audit.

``python -m tests.chaos`` (``make chaos``) runs it at full size and writes
``tests/chaos/RESULTS.md``; ``tests/chaos/test_chaos.py`` runs a short version in
``make test``.

Per store (PostgreSQL direct, PostgreSQL through PgBouncer in transaction mode, Redis),
3-5 worker processes run a :class:`~lease_core.Scheduler` with many jobs firing every few
hundred milliseconds. Each worker reaches the store through its own TCP proxy
(:mod:`tests.chaos.proxy`). Faults, one at a time from a seeded RNG; a fault on a worker
hits the member ranked first (rendezvous rank 0, as the workers rank the live instances)
for a job drawn at random, so the fleet must re-rank that job's slots:

- ``kill``: SIGKILL a worker, then start a new one in its place;
- ``stop``: SIGSTOP a worker for 1.5-2.5 leases, then SIGCONT (a zombie holder);
- ``partition``: the worker's proxy stops forwarding, sockets open, for 1.5-2.5 leases;
- ``restart``: restart the store (the database behind PgBouncer); the fault lasts until
  the store answers again where workers connect (see ``StoreProbe``), so restarts do not
  pile up into one outage;
- ``skew``: stop a worker gracefully (hand-over) and start it again with its wall clock and
  its scheduler's local clock an hour ahead or behind (worker 0 starts an hour ahead);
- ``join``: start one more worker process (a new instance, with a proxy of its own), up to
  ``max_workers``;
- ``leave``: stop a worker gracefully for good (it hands over and leaves the fleet), down
  to ``min_workers``;
- ``zombie``: the worker stops itself (SIGSTOP) just before its next fenced write of a
  kind drawn at random (a checkpoint; a fenced transaction on PostgreSQL, a finish on
  Redis) and is resumed once another worker claimed its run (at most 1.5-2.5 leases
  later), so that the write goes out from a superseded attempt while the run runs again:
  the store must refuse it (recorded as ``zombie-cp``, ``-tx``, ``-fin``; ``zombie-idle``
  when no such write came within 2 s). The write is made shielded from the handler's
  cancellation by its lease deadline, as a write already sent would be (a ``thawed``
  record says what became of it). ``zombie-end`` and ``zombie-cp`` (in a run's first
  faults) ask for the write that ends the run or a checkpoint; ``zombie-cancel`` stops the
  worker before the write that ends its run, cancels that run through the store and
  resumes the worker at once, within the cancel's grace: the write must be refused.

Every handler reads its checkpoint, records ``start`` (the un-fenced effect: an
append-only JSON line, see :mod:`tests.chaos.worker`), writes checkpoints
``{"a": attempt, "step": n}`` (verifying before each write that nobody else wrote), and on
PostgreSQL inserts its effect into a table unique on (job, slot) inside
``ctx.transaction()``. The audit (:func:`tests.chaos.run.audit`) reads the history, runs,
checkpoints and effect rows from the store and the records of every worker, and counts:

- two attempts holding a live lease at once: a claim the store acknowledged as won
  while another attempt of the run surely held a live lease (the latest expiry the store
  acknowledged setting for it, by its claim or a renewal, the workers recording both),
  that attempt not having ended by itself before (completed, failed, timed out, handed
  over);
- double completions: runs with two ``completed`` attempts;
- cancelled runs taken over (an attempt claimed after the cancel) or completed (an
  attempt completed, a fenced effect committed, or a run status other than
  ``cancelled``);
- a finish from a superseded attempt: a finish the store acknowledged that was sent after
  another attempt of the run (kept in its history) had been claimed;
- double fenced effects: two committed effect transactions for one run;
- writes accepted from a superseded attempt: a finished outcome on an attempt that is not
  the run's last; an effect row or committed transaction of an attempt that is not the
  completing, last one; a checkpoint seen changed by another attempt while one held the
  run, or a stored checkpoint whose writer is older than a later writer;
- checkpoints going backwards: an attempt reading less than an earlier attempt was told
  it wrote, or a stored checkpoint below a step some attempt wrote;
- runs left running: runs whose slot is more than four leases old and still open, once
  the faults stopped and four leases passed (the audit waits up to 30 s more for a
  starved machine to catch up, and reports how long it took), while the fleet is alive
  or after every worker stopped gracefully;
- takeover latency: from the fault (kill, stop, partition) of the holder to the next
  attempt's claim; it should stay within lease + one check interval;
- un-fenced duplicates: runs whose handler started (or ran to the end) in two attempts;
- slots nobody claimed (of every job, the flaky one too), and of those the ones from
  which the store answered no probe until the job's next slot was due (only the newest
  slot missed while the store is unreachable is claimed when it returns);
- slots never claimed while the store answered (an invariant): every other missed slot,
  one the store answered a probe for before the job's next slot was due, counted from
  the store's records (its history) and the probe's answers;
- faults on a job's first-ranked member (as the store's history shows the fleet ranked
  it: the member that made the first claim of the job's latest slot before the fault),
  and the delay from each slot to its first claim (about one check interval when the
  first-ranked member is gone and the next claims).
"""
