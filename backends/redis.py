"""The Redis backend: every mutation is one Lua script, and lease time is Redis's ``TIME``.

The scripts live in ``backends/redis_lua/*.lua`` (each prefixed with ``_prelude.lua``),
are registered with the driver (``register_script``) and run with ``EVALSHA``; a
``NOSCRIPT`` reply (after ``SCRIPT FLUSH`` or a restart) loads the script and retries (see
:mod:`adapters.redis`). A claim or a finish is one script call (a claim adds ``SADD`` to
the jobs set, in the same round trip, the first time this process claims its job).
Batched calls (claim_many, heartbeat, hand-over, check, register) send one
non-transactional pipeline: one round trip, and valid on a Cluster because each command
touches one slot (the Cluster client groups them by slot). A heartbeat sends one script
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
``{P/E}:job``                hash    ``first_seen``, ``last_slot``, ``seq`` (attempt count),
                                     ``sid`` (marker of the job's data), ``lost`` and
                                     ``quiet`` (when a data loss was found, and the end
                                     of its quarantine; ms)
``{P/E}:run:<slot>``         hash    ``st`` status, ``att`` attempt, ``tok`` token, ``inst``
                                     instance, ``exp`` expiry (ms), ``cp`` checkpoint JSON,
                                     ``n`` attempts still in the history
``{P/E}:open``               zset    slots of runs ``running`` or ``handed_over``
``{P/E}:hist``               zset    attempt ids ``<slot>:<attempt>`` by insertion order
``{P/E}:att``                hash    attempt id -> JSON record
``{P/E}:done``               zset    finished attempt ids by finish time (for the TTL)
``{P/E}:orphan``             set     slots whose attempts were all trimmed
===========================  ======  =====================================================

History is trimmed by :meth:`RedisBackend.prune` (``trim.lua``), which the scheduler's
ticker calls for every job (``history_size`` newest, and ``history_ttl``), never by a
claim; finished runs with no attempt left are deleted, so a job's keys stay bounded.
Open runs are never deleted.

``wait_replicas=N`` sends ``WAIT N timeout`` in the same round trip after a claim or a
heartbeat. When fewer replicas acknowledge, the claim does **not** count as won and the
heartbeat is not counted as renewed: both raise
:class:`~lease_core.errors.BackendUnavailable`. The unacknowledged claim stays in the
primary, unheld, until its lease expires; a backup then takes it over.

Data loss. Data survives a server restart only as far as the server persists it (RDB or
AOF), and a failover to a lagging replica loses the newest writes. The first claim of a
job writes a random marker into the job's hash (``sid``), and every claim returns it;
the backend remembers it per job and sends it with its next claim of the job, with the
longest lease it has claimed or renewed. A claim that finds the marker missing or
different knows the job's data was lost, and the script writes, atomically, a new marker,
the loss time ``lost`` (now, unless recorded already) and a quarantine ``quiet`` = ``lost``
+ that longest lease (raised by later callers that know a longer one, never lowered).
Until ``quiet`` every claim of the job answers ``RUNNING`` with no run (``run_status``
``None``, ``expires_ms`` = ``quiet``) and writes nothing: the scheduler claims again at
its next tick. By then every lease that may have been live at the loss has expired, and
its holder has learnt at a heartbeat that its lease is gone. :meth:`RedisBackend.check`
reads the markers too: a watched run missing from a job whose marker is gone or changed,
or whose quarantine is not over, was lost, not deleted (``CheckResult.lost``), and the
scheduler claims it again. The
marker lives with the job's keys, so on a Cluster the loss of one shard is found for
exactly the jobs on it.
A process that never claimed the job before the loss cannot tell a lost job from a new
one: until a process that did claims it (or finds it at its next slot), such a fresh
process may win attempt 1 of a run whose old holder has not yet learnt of the loss.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

from lease_core._packages import require_own

require_own("adapters")  # before importing from it: a foreign one may shadow it

from adapters.redis import Command, RedisAdapter, redis_adapter
from lease_core._durations import Duration, parse_duration, to_ms
from lease_core._redact import redact
from lease_core._registry import merge_options, split_url_options
from lease_core._structures import (
    Attempt,
    CheckResult,
    ClaimRequest,
    ClaimResult,
    ClaimStatus,
    HeartbeatResult,
    JobInfo,
    Lease,
    Outcome,
    Reason,
    RunInfo,
    RunState,
    RunStatus,
    ms_to_datetime,
)
from lease_core.abc import (
    Backend,
    check_every,
    check_prune,
    decode_checkpoint,
    encode_checkpoint,
    finish_status,
)
from lease_core.errors import BackendUnavailable, ConfigurationError, StoreFormatError

__all__ = ["HEARTBEAT_BATCH", "SCRIPTS", "SCRIPT_BATCH", "STORE_FORMAT", "RedisBackend",
           "Script"]

#: Field prefix of a workflow's steps in the ``{P}:meta`` hash.
_WORKFLOW_FIELD = "workflow:"

#: The store format this version writes; a store with a newer one is refused.
STORE_FORMAT = 1

_PREFIX = re.compile(r"[A-Za-z0-9_.:\-]{1,200}")
_SCRIPTS = ("open_store", "claim", "claim_many", "heartbeat", "finish", "hand_over",
            "checkpoint", "register", "history", "trim")
#: Files prepended to a script after the prelude (the claim function it calls).
_INCLUDES = {"claim": ("_claim",), "claim_many": ("_claim",)}
#: Claims per ``claim_many.lua`` call at most: one script call keeps the server busy, so
#: a large batch goes as several calls (in the same pipeline).
SCRIPT_BATCH = 100
#: Leases one ``heartbeat.lua`` call renews at most on a server that is not a Cluster.
HEARTBEAT_BATCH = 1000


@dataclass(frozen=True)
class Script:
    """One Lua script of this backend: its name, full source (prelude included) and SHA-1.

    Public for tools that send the very same scripts through a raw client (the benchmarks
    compare the library with that); the scripts' text is not a stable API.
    """

    name: str
    source: str
    sha: str


def _load_scripts() -> dict[str, Script]:
    folder = resources.files("backends") / "redis_lua"
    prelude = (folder / "_prelude.lua").read_text(encoding="utf-8")
    scripts = {}
    for name in _SCRIPTS:
        parts = [prelude] + [(folder / f"{part}.lua").read_text(encoding="utf-8")
                             for part in (*_INCLUDES.get(name, ()), name)]
        source = "\n".join(parts)
        sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()
        scripts[name] = Script(name, source, sha)
    return scripts


SCRIPTS = _load_scripts()


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return str(value)


def _members(kind: Any) -> dict[Any, Any]:
    """Enum members by value, as text and as the bytes a driver replies with."""
    found: dict[Any, Any] = {"": None, b"": None}
    for member in kind:
        found[member.value] = found[member.value.encode()] = member
    return found


_CLAIM_STATUS = _members(ClaimStatus)
_REASON = _members(Reason)
_RUN_STATUS = _members(RunStatus)


def _claim_fields(reply: Any) -> list[Any]:
    """The claim script's reply, ``status|now|attempt|reason|expires|run_status|marker|
    instance`` (``''`` for none; the instance last, whatever it holds), split."""
    fields: list[Any] = reply.split(b"|" if isinstance(reply, bytes) else "|", 7)
    return fields


def _counted_replies(blob: Any, encoding: str = "utf-8",
                     errors: str = "strict") -> list[Any]:
    """Split ``claim_many.lua``'s reply: ``<length>:<reply>`` per claim (length in bytes).

    A client that decodes replies answers text: it is encoded back with the client's own
    ``encoding`` (the lengths count the bytes the server sent), and each reply decoded
    again.
    """
    text = not isinstance(blob, bytes)
    data = str(blob).encode(encoding, errors) if text else blob
    out: list[Any] = []
    at, size = 0, len(data)
    while at < size:
        colon = data.index(b":", at)
        end = colon + 1 + int(data[at:colon])
        reply = data[colon + 1:end]
        out.append(reply.decode(encoding, errors) if text else reply)
        at = end
    return out


def _claim_result(request: ClaimRequest, fields: list[Any]) -> ClaimResult:
    """A claim's :func:`_claim_fields` as a :class:`ClaimResult`."""
    status, now, attempt, reason, expires, run_status, _marker, instance = fields
    return ClaimResult(
        _CLAIM_STATUS[status], request.job, request.slot, int(now), int(attempt),
        _REASON[reason], int(expires) if expires else None, _RUN_STATUS[run_status],
        _text(instance) or None,
    )


def _time_ms(reply: Any) -> int:
    seconds, micros = reply
    return int(_text(seconds)) * 1000 + int(_text(micros)) // 1000


#: Options the backend takes, as keywords or from a URL's query.
_OPTIONS = ("prefix", "namespace", "wait_replicas", "wait_timeout")
#: Query parameters redis-py reads from a URL as strings (besides its typed ones).
_DRIVER_PARAMS = ("username", "password", "client_name", "lib_name", "lib_version",
                  "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_ca_data",
                  "ssl_certfile", "ssl_keyfile", "ssl_password")


def _check_driver_params(url: str) -> None:
    """Refuse a query parameter that neither the backend nor redis-py knows."""
    try:
        from redis.connection import URL_QUERY_ARGUMENT_PARSERS
    except ImportError:  # the driver's absence is reported when connecting
        return
    query = urlsplit(url).query
    known = (*_OPTIONS, *_DRIVER_PARAMS, *URL_QUERY_ARGUMENT_PARSERS)
    unknown = [key for key, _ in parse_qsl(query, keep_blank_values=True) if key not in known]
    if unknown:
        raise ConfigurationError(
            f"the Redis URL {redact(url)!r} has the unknown query parameter "
            f"{', '.join(map(repr, unknown))}; it accepts: {', '.join(sorted(known))}"
        )


def _validate_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ConfigurationError(
            f"prefix={prefix!r} cannot be used in Redis key names; use 1 to 200 letters, "
            "digits and the characters '_', '.', ':' and '-' (no braces, slashes or spaces)"
        )
    return prefix


class RedisBackend(Backend):
    """Coordinate through Redis (or Valkey), 6.2 or newer, standalone or Cluster.

    ``connection`` is ``None`` (``redis://localhost:6379/0``), a URL, a redis-py or
    valkey-py client (asyncio or sync) or a connection pool; see :mod:`adapters.redis`.

    .. note:: A client or pool passed in is never closed; a client the backend made from
       a URL is closed by the last :meth:`close`.

    ``prefix`` starts every key (see the module docs for the layout); ``namespace`` is
    another name for it (the keyword every backend accepts). ``wait_replicas``
    makes claims and heartbeats wait, up to ``wait_timeout``, for that many replicas to
    acknowledge them; a short count raises
    :class:`~lease_core.errors.BackendUnavailable` instead of winning or renewing.

    A call made before :meth:`start` starts the backend itself; :meth:`close` then
    releases that hold like any other.
    """

    schemes = ("redis", "rediss", "unix")

    def __init__(
        self,
        connection: object = None,
        *,
        prefix: str | None = None,
        namespace: str | None = None,
        wait_replicas: int | None = None,
        wait_timeout: Duration | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        from_url: dict[str, str] = {}
        if isinstance(connection, str):
            connection, from_url = split_url_options(connection, _OPTIONS)
            _check_driver_params(connection)
        keywords = {"prefix": prefix, "namespace": namespace, "wait_replicas": wait_replicas,
                    "wait_timeout": wait_timeout, **options}
        merged = merge_options("RedisBackend", keywords, from_url, _OPTIONS)
        names = [merged[k] for k in ("prefix", "namespace") if merged.get(k) is not None]
        if len(names) > 1 and names[0] != names[1]:
            raise ConfigurationError(
                f"RedisBackend got prefix={names[0]!r} and namespace={names[1]!r}; "
                "give one of them"
            )
        self.prefix = _validate_prefix(names[0] if names else "anarchon_runs")
        wait_replicas = merged.get("wait_replicas")
        if isinstance(wait_replicas, str) and wait_replicas.isdigit():  # from the URL
            wait_replicas = int(wait_replicas)
        if wait_replicas is not None and (
            isinstance(wait_replicas, bool)
            or not isinstance(wait_replicas, int)
            or wait_replicas < 1
        ):
            raise ConfigurationError(
                f"wait_replicas={wait_replicas!r} must be a whole number of replicas, at "
                "least 1, or None to not wait"
            )
        self.wait_replicas = wait_replicas
        self._wait_timeout_ms = to_ms(
            parse_duration(merged.get("wait_timeout", "1s"), what="wait_timeout")
        )
        self._connection = connection
        self._adapter: RedisAdapter | None = None
        # Jobs this process has added to the jobs set ({P}:jobs); a claim of another job
        # adds it in the same round trip.
        self._listed: set[str] = set()
        self._tags: dict[str, str] = {}  # job -> hash tag
        # The marker of each job's data (its job hash's 'sid') as this backend last saw
        # it, and the longest lease it has claimed or renewed: a claim that finds another
        # marker knows the data was lost (see "Data loss" in the module docs).
        self._markers: dict[str, str] = {}
        self._longest_ms = 0
        # Per job, the end of the quarantine its last claim found: until then every
        # missing run of the job was lost with the data (nothing is deleted meanwhile).
        self._quiet: dict[str, int] = {}

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisBackend:
        """Make a backend on the server at ``url`` (``redis://``, ``rediss://``, ``unix://``).

        ``prefix`` (or ``namespace``), ``wait_replicas`` and ``wait_timeout`` may be given
        in the URL's query as well as keywords; the driver's own query parameters
        (``socket_timeout``, ``socket_connect_timeout``, ``max_connections``, ...) pass
        through to redis-py.
        """
        return cls(url, **options)

    def __repr__(self) -> str:
        where = self._adapter.where if self._adapter else "not started"
        return f"{type(self).__name__}(prefix={self.prefix!r}, {where})"

    # -- keys ------------------------------------------------------------------------

    def _tag(self, job: str) -> str:
        tag = self._tags.get(job)
        if tag is None:
            if len(self._tags) > 100_000:  # a bound for processes that make up job names
                self._tags.clear()
            tag = self._tags[job] = "{" + self.prefix + "/" + quote(job, safe="") + "}"
        return tag

    def _run_key(self, job: str, slot: int) -> str:
        return f"{self._tag(job)}:run:{int(slot)}"

    def _job_keys(self, job: str) -> dict[str, str]:
        tag = self._tag(job)
        return {part: f"{tag}:{part}" for part in
                ("job", "open", "hist", "att", "done", "orphan")}

    @property
    def _meta_key(self) -> str:
        return "{" + self.prefix + "}:meta"

    @property
    def _maintenance_key(self) -> str:
        return "{" + self.prefix + "}:maintenance"

    @property
    def _jobs_key(self) -> str:
        return "{" + self.prefix + "}:jobs"

    # -- plumbing --------------------------------------------------------------------

    async def _open(self) -> None:
        adapter = redis_adapter(self._connection)
        try:
            await adapter.load_scripts([s.source for s in SCRIPTS.values()])
            self._adapter = adapter
            (found,) = await self._run([self._eval("open_store", [self._meta_key],
                                                   [STORE_FORMAT])])
        except BaseException:
            self._adapter = None
            await adapter.aclose()
            raise
        if int(found) > STORE_FORMAT:
            self._adapter = None
            await adapter.aclose()
            raise StoreFormatError(
                f"the keys under prefix {self.prefix!r} were written in store format "
                f"{int(found)}, newer than this anarchon's {STORE_FORMAT}; upgrade anarchon "
                "or use another prefix"
            )

    async def _close(self) -> None:
        adapter, self._adapter = self._adapter, None
        if adapter is not None:
            await adapter.aclose()

    async def _require(self) -> RedisAdapter:
        if self._adapter is None:
            # Used without start(): open now; the next close() releases it.
            await self.start()
        assert self._adapter is not None
        return self._adapter

    @staticmethod
    def _eval(name: str, keys: Sequence[str], args: Sequence[str | int]) -> Command:
        return ("EVALSHA", SCRIPTS[name].sha, len(keys), *keys, *args)

    async def _run(self, commands: Sequence[Command]) -> list[Any]:
        """Send ``commands`` in one round trip (the adapter loads scripts the server lost)."""
        adapter = await self._require()
        replies = await adapter.execute(commands)
        for reply in replies:
            if isinstance(reply, Exception):
                raise adapter.translate(reply) or reply
        return replies

    def _wait(self) -> list[Command]:
        if self.wait_replicas is None:
            return []
        return [("WAIT", self.wait_replicas, self._wait_timeout_ms)]

    def _check_wait(self, reply: Any, what: str) -> None:
        acks = int(reply)
        if self.wait_replicas is not None and acks < self.wait_replicas:
            raise BackendUnavailable(
                f"{what} was acknowledged by {acks} of wait_replicas={self.wait_replicas} "
                f"replicas within {self._wait_timeout_ms} ms, so it does not count; check "
                "the replicas of the Redis primary or lower wait_replicas"
            )

    # -- contract --------------------------------------------------------------------

    async def now_ms(self) -> int:
        """Return Redis's ``TIME`` in epoch milliseconds."""
        (reply,) = await self._run([("TIME",)])
        return _time_ms(reply)

    async def register_jobs(self, jobs: Sequence[str]) -> dict[str, JobInfo]:
        """Record the jobs as seen and list their open runs, in one round trip."""
        names = list(dict.fromkeys(jobs))
        if not names:
            return {}
        commands = []
        for name in names:
            keys = self._job_keys(name)
            commands.append(self._eval("register", [keys["job"], keys["open"]], []))
        commands.append(("SADD", self._jobs_key, *names))
        replies = await self._run(commands)
        out = {}
        for name, reply in zip(names, replies, strict=False):
            first, last, new, *slots = (_text(v) for v in reply)
            out[name] = JobInfo(name, int(first), int(last) if last else None,
                                tuple(sorted(int(s) for s in slots)), new == "1")
        return out

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult]:
        """Make the claims in order, in one pipelined round trip.

        A lone claim (:meth:`~lease_core.abc.Backend.claim`, inherited: a batch of one) is
        one ``claim.lua`` call.
        On a server that is not a Cluster, one ``claim_many.lua`` call makes up to
        :data:`SCRIPT_BATCH` claims (each exactly as ``claim.lua`` would), sent as one
        argument per claim and answered as one string for the call: packing and reading
        a value per field cost the client more than the claims cost the server. On a
        Cluster each claim is its own ``claim.lua`` call, routed to its job's slot, as is
        every claim of a batch with a token holding ``|`` (the fields' separator).
        """
        if not requests:
            return []
        adapter = await self._require()
        self._longest_ms = max(self._longest_ms, *(int(r.lease_ms) for r in requests))
        # One script call per SCRIPT_BATCH claims of one instance; on a Cluster one call
        # per claim (each job's keys are in the slot of its own hash tag).
        batched = not (len(requests) == 1 or adapter.cluster
                       or any(r.instance_id != requests[0].instance_id or "|" in r.token
                              for r in requests))
        if batched:
            commands = [self._claims_command(requests[at:at + SCRIPT_BATCH])
                        for at in range(0, len(requests), SCRIPT_BATCH)]
        else:
            commands = [self._claim_command(request) for request in requests]
        calls = len(commands)
        new = [job for job in dict.fromkeys(r.job for r in requests) if job not in self._listed]
        if new:
            commands.append(("SADD", self._jobs_key, *new))
        replies = await self._run([*commands, *self._wait()])
        if len(self._listed) > 100_000:  # a bound for processes that make up job names
            self._listed.clear()
        self._listed.update(new)
        if batched:  # one string of counted claim replies per script call
            replies = [*(reply for batch in replies[:calls]
                         for reply in _counted_replies(batch, *adapter.encoding)),
                       *replies[calls:]]
        fields = [_claim_fields(reply) for reply in replies[:len(requests)]]
        results = [_claim_result(request, f)
                   for request, f in zip(requests, fields, strict=True)]
        if len(self._markers) > 100_000:  # a bound for processes that make up job names
            self._markers.clear()
            self._quiet.clear()
        for request, f in zip(requests, fields, strict=True):
            self._markers[request.job] = _text(f[6])
        for result in results:
            if result.status is ClaimStatus.RUNNING and result.run_status is None:
                self._quiet[result.job] = result.expires_ms or 0
        won = [r for r in results if r.status is ClaimStatus.WON]
        if won and self.wait_replicas is not None:
            what = (f"the claim of {won[0].job!r} slot {won[0].slot}" if len(won) == 1
                    else f"the claims of {len(won)} runs")
            self._check_wait(replies[-1], what)
        return results

    def _claims_command(self, requests: Sequence[ClaimRequest]) -> Command:
        """One ``claim_many.lua`` call for ``requests`` (a server that is not a Cluster)."""
        args: list[str | int] = [requests[0].instance_id, self._longest_ms]
        keys = []
        markers = self._markers
        for request in requests:
            keys.append(f"{self._tag(request.job)}:job")
            limit = request.max_attempts
            args.append(f"{int(request.slot)}|{request.token}|{int(request.lease_ms)}|"
                        f"{request.reason.value}|{1 if request.overlap_skip else 0}|"
                        f"{'' if limit is None else int(limit)}|{markers.get(request.job, '')}")
        return self._eval("claim_many", keys, args)

    def _claim_command(self, request: ClaimRequest) -> Command:
        tag = self._tag(request.job)
        args: list[str | int] = [
            int(request.slot), request.instance_id, request.token, int(request.lease_ms),
            request.reason.value, 1 if request.overlap_skip else 0,
            "" if request.max_attempts is None else int(request.max_attempts),
            max(0, int(request.history_size)),
            "" if request.history_ttl_ms is None else int(request.history_ttl_ms),
            f"{tag}:run:",
            # the script reads these two from the end of its arguments
            self._markers.get(request.job, ""), self._longest_ms,
        ]
        return self._eval("claim", [f"{tag}:job", f"{tag}:run:{int(request.slot)}",
                                    f"{tag}:open", f"{tag}:hist", f"{tag}:att", f"{tag}:done",
                                    f"{tag}:orphan"], args)

    async def heartbeat(self, leases: Sequence[Lease]) -> HeartbeatResult:
        """Renew every lease to ``now + lease_ms`` in one round trip.

        On a server that is not a Cluster, one script call renews up to
        :data:`HEARTBEAT_BATCH` leases of any jobs; on a Cluster, one script call per
        job renews all of that job's leases (their keys share the job's hash tag, so one
        slot). The calls go in one pipeline.
        """
        if not leases:
            return HeartbeatResult(await self.now_ms())
        adapter = await self._require()
        groups: list[list[Lease]]
        if adapter.cluster:
            by_job: dict[str, list[Lease]] = {}
            for lease in leases:
                by_job.setdefault(lease.job, []).append(lease)
            groups = list(by_job.values())
        else:
            groups = [list(leases[at:at + HEARTBEAT_BATCH])
                      for at in range(0, len(leases), HEARTBEAT_BATCH)]
        commands = []
        for group in groups:
            args: list[str | int] = []
            for lease in group:
                args += [lease.token, int(lease.lease_ms)]
                self._longest_ms = max(self._longest_ms, int(lease.lease_ms))
            commands.append(self._eval(
                "heartbeat", [self._run_key(lease.job, lease.slot) for lease in group], args))
        replies = await self._run([*commands, *self._wait()])
        held: set[str] = set()
        now = 0
        for group, (at, flags) in zip(groups, replies, strict=False):
            now = max(now, int(at))
            held.update(lease.token for lease, flag in zip(group, _text(flags), strict=True)
                        if flag == "1")
        if held and self.wait_replicas is not None:
            self._check_wait(replies[-1], f"the heartbeat of {len(held)} lease(s)")
        return HeartbeatResult(now, frozenset(held))

    async def finish_many(
        self, items: Sequence[tuple[Lease, Outcome, str | None]]
    ) -> list[bool]:
        """End the attempts in order, one ``finish.lua`` call each, in one round trip
        (:meth:`~lease_core.abc.Backend.finish` is inherited: a batch of one)."""
        commands = [self._finish_command(lease, finish_status(outcome).value, error)
                    for lease, outcome, error in items]
        if not commands:
            return []
        return [int(done) == 1 for done in await self._run(commands)]

    def _finish_command(self, lease: Lease, status: str, error: str | None) -> Command:
        tag = self._tag(lease.job)
        return self._eval(
            "finish",
            [f"{tag}:run:{int(lease.slot)}", f"{tag}:open", f"{tag}:att", f"{tag}:done"],
            [lease.token, int(lease.slot), status, 0 if error is None else 1, error or ""],
        )

    async def hand_over(self, leases: Sequence[Lease]) -> frozenset[str]:
        """Mark each held run ``handed_over``, in one pipelined round trip."""
        if not leases:
            return frozenset()
        commands = []
        for lease in leases:
            keys = self._job_keys(lease.job)
            commands.append(self._eval(
                "hand_over", [self._run_key(lease.job, lease.slot), keys["att"], keys["done"]],
                [lease.token, int(lease.slot)],
            ))
        replies = await self._run(commands)
        return frozenset(lease.token for lease, r in zip(leases, replies, strict=True)
                         if int(r) == 1)

    async def check(self, runs: Sequence[tuple[str, int]]) -> CheckResult:
        """Read the watched runs and the server time in one pipelined round trip.

        The same round trip reads the data markers of the runs' jobs: a missing run of a
        job whose marker is gone or changed, or whose quarantine is not over, was lost
        with the data (``lost``).
        """
        commands: list[Command] = [("TIME",)]
        commands += [("HMGET", self._run_key(job, slot), "st", "att", "exp", "inst")
                     for job, slot in runs]
        known = [job for job in dict.fromkeys(job for job, _ in runs) if job in self._markers]
        commands += [("HGET", f"{self._tag(job)}:job", "sid") for job in known]
        replies = await self._run(commands)
        found = {}
        for (job, slot), reply in zip(runs, replies[1:], strict=False):
            st, att, exp, inst = (None if v is None else _text(v) for v in reply)
            if st is not None:
                found[(job, slot)] = RunState(job, slot, RunStatus(st), int(att or 0),
                                              int(exp) if exp else None, inst)
        now = _time_ms(replies[0])
        changed = {job for job, marker in zip(known, replies[1 + len(runs):], strict=True)
                   if marker is None or _text(marker) != self._markers.get(job)
                   or now < self._quiet.get(job, 0)}
        lost = frozenset(run for run in runs if run[0] in changed and run not in found)
        return CheckResult(now, found, lost)

    async def history(self, job: str | None = None, limit: int = 100) -> list[Attempt]:
        """Return attempts newest first, of one job or of every job under the prefix."""
        if limit <= 0:
            return []
        if job is None:
            (members,) = await self._run([("SMEMBERS", self._jobs_key)])
            jobs = sorted(_text(m) for m in members)
        else:
            jobs = [job]
        if not jobs:
            return []
        commands = []
        for name in jobs:
            keys = self._job_keys(name)
            commands.append(self._eval("history", [keys["hist"], keys["att"]], [int(limit)]))
        items = []
        for name, records in zip(jobs, await self._run(commands), strict=True):
            items += [self._attempt(name, _text(raw)) for raw in records]
        items.sort(key=lambda a: (a.claimed_at, a.slot, a.attempt), reverse=True)
        return items[:limit]

    async def register_workflows(self, workflows: Mapping[str, Sequence[str]]) -> None:
        """Record each workflow's steps in the ``{P}:meta`` hash (``workflow:<name>``)."""
        if not workflows:
            return
        fields: list[str] = []
        for name, steps in workflows.items():
            fields += [_WORKFLOW_FIELD + name, json.dumps(list(steps))]
        await self._run([("HSET", self._meta_key, *fields)])

    async def workflows(self) -> dict[str, list[str]]:
        """Return every recorded workflow's steps, in order."""
        (raw,) = await self._run([("HGETALL", self._meta_key)])
        pairs = raw.items() if isinstance(raw, dict) else zip(raw[::2], raw[1::2], strict=True)
        found = {}
        for key, value in pairs:
            name = _text(key)
            if name.startswith(_WORKFLOW_FIELD):
                found[name[len(_WORKFLOW_FIELD):]] = [str(s) for s in json.loads(_text(value))]
        return found

    async def prune_many(self, jobs: Sequence[str], *, keep: int | None = None,
                         older_than_ms: int | None = None,
                         batch: int = 1000) -> dict[str, int]:
        """Trim the jobs' histories, one ``trim.lua`` call each, in one pipelined round trip
        (:meth:`~lease_core.abc.Backend.prune` is inherited: a batch of one)."""
        check_prune(keep, older_than_ms, batch)
        names = list(dict.fromkeys(jobs))
        if not names:
            return {}
        commands = []
        for job in names:
            keys = self._job_keys(job)
            commands.append(self._eval(
                "trim", [keys["hist"], keys["att"], keys["done"], keys["orphan"]],
                ["" if keep is None else keep, "" if older_than_ms is None else older_than_ms,
                 f"{self._tag(job)}:run:", batch],
            ))
        replies = await self._run(commands)
        return {job: int(count) for job, count in zip(names, replies, strict=True)}

    async def maintenance_due(self, instance_id: str, every_ms: int) -> bool:
        """Win the maintenance period with one ``SET NX PX`` (the key expires with it)."""
        check_every(every_ms)
        (reply,) = await self._run([("SET", self._maintenance_key, instance_id, "NX",
                                     "PX", every_ms)])
        return reply is not None and reply is not False

    async def jobs(self) -> list[str]:
        """Return every job under the prefix, sorted."""
        (members,) = await self._run([("SMEMBERS", self._jobs_key)])
        return sorted(_text(m) for m in members)

    async def runs(self, job: str | None = None, *, open_only: bool = False,
                   limit: int = 100) -> list[RunInfo]:
        """Return runs, newest slot first: open runs and those of the latest attempts.

        Three pipelined round trips at most: the jobs, their open and recent slots, the
        runs themselves.
        """
        if limit < 0:
            raise ConfigurationError(f"limit={limit!r} must be 0 or more")
        names = await self.jobs() if job is None else [job]
        if not names or limit == 0:
            return []
        commands: list[Command] = []
        for name in names:
            keys = self._job_keys(name)
            commands.append(("ZRANGE", keys["open"], 0, -1))
            if not open_only:
                commands.append(("ZREVRANGE", keys["hist"], 0, limit - 1))
        replies = iter(await self._run(commands))
        wanted: list[tuple[str, int]] = []
        for name in names:
            slots = {int(_text(s)) for s in next(replies)}
            if not open_only:
                slots |= {int(_text(i).split(":")[0]) for i in next(replies)}
            wanted += [(name, slot) for slot in sorted(slots, reverse=True)[:limit]]
        if not wanted:
            return []
        rows = await self._run([("HMGET", self._run_key(name, slot), "st", "att", "inst", "exp")
                                for name, slot in wanted])
        found = []
        for (name, slot), row in zip(wanted, rows, strict=True):
            st, att, inst, exp = (None if v is None else _text(v) for v in row)
            if st is None or (open_only and RunStatus(st).finished):
                continue
            found.append(RunInfo(name, slot, RunStatus(st), int(att or 0), inst,
                                 int(exp) if exp and st == "running" else None))
        found.sort(key=lambda r: (-r.slot, r.job))
        return found[:limit]

    @staticmethod
    def _attempt(job: str, raw: str) -> Attempt:
        rec = json.loads(raw)
        finished = rec.get("f")
        outcome = rec.get("o")
        return Attempt(
            job, int(rec["s"]), int(rec["a"]), str(rec["i"]), Reason(rec["r"]),
            ms_to_datetime(int(rec["c"])),
            ms_to_datetime(int(finished)) if finished is not None else None,
            Outcome(outcome) if outcome else None, rec.get("e"),
        )

    async def get_checkpoint(self, job: str, slot: int) -> Any:
        """Return the run's checkpoint, or ``None``."""
        (text,) = await self._run([("HGET", self._run_key(job, slot), "cp")])
        return decode_checkpoint(None if text is None else _text(text))

    async def set_checkpoint(self, lease: Lease, value: Any) -> bool:
        """Store the checkpoint as JSON text, fenced by the lease's token."""
        text = encode_checkpoint(value)
        (done,) = await self._run([self._eval(
            "checkpoint", [self._run_key(lease.job, lease.slot)], [lease.token, "set", text]
        )])
        return int(done) == 1

    async def delete_checkpoint(self, lease: Lease) -> bool:
        """Remove the checkpoint, fenced by the lease's token."""
        (done,) = await self._run([self._eval(
            "checkpoint", [self._run_key(lease.job, lease.slot)], [lease.token, "del", ""]
        )])
        return int(done) == 1
