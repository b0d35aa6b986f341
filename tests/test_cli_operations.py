"""``anarchon trigger|pause|resume JOB`` and ``anarchon retry|cancel JOB@SLOT``.

On PostgreSQL, directly and through PgBouncer in transaction mode, and on Redis. The
store's runs are written through the backend contract (a claim and a finish, as an
instance would); each command's effect is read back from the store. A refusal exits 2
and changes nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from lease_core import Admin, Outcome, RunStatus, backend_from_url
from lease_core.abc import ClaimRequest, Lease
from lease_core.cli import main
from tests.stores.postgres import PgServer, drop_tables, unique_table
from tests.stores.redis import delete_prefix


@pytest.fixture(params=["pg16_server", "pgbouncer_server", "redis62_server"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "redis62_server":
        base = request.getfixturevalue("redis62_server").url
        prefix = f"anarchon_t_{uuid.uuid4().hex[:12]}"
        yield f"{base}?prefix={prefix}"
        delete_prefix(base, prefix)
        return
    server: PgServer = request.getfixturevalue(request.param)
    table = unique_table()
    yield f"{server.dsn}?table={table}"
    admin: PgServer = request.getfixturevalue("pg16_server")
    anyio.run(drop_tables, admin.admin_dsn, table)


def store(url: str, action: Any) -> Any:
    async def run() -> Any:
        backend = backend_from_url(url)
        await backend.start()
        try:
            return await action(backend)
        finally:
            await backend.close()
    return anyio.run(run)


def run_ending(url: str, slot: int, outcome: Outcome) -> None:
    async def action(backend: Any) -> None:
        await backend.register_jobs(["sync"])
        await backend.claim(ClaimRequest("sync", slot, "i-1", f"t{slot}", 30_000))
        if outcome is not Outcome.LOST:  # LOST: left running
            assert await backend.finish(Lease("sync", slot, f"t{slot}", 30_000), outcome,
                                        "boom" if outcome is Outcome.FAILED else None)
    store(url, action)


def statuses(url: str) -> dict[int, RunStatus]:
    async def action(backend: Any) -> dict[int, RunStatus]:
        return {r.slot: r.status for r in await backend.runs("sync", limit=100)}
    return dict(store(url, action))


def test_operations_act_on_the_store(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    run_ending(url, 1000, Outcome.FAILED)
    run_ending(url, 2000, Outcome.COMPLETED)
    run_ending(url, 3000, Outcome.LOST)
    assert main(["pause", "sync", "--url", url]) == 0
    assert store(url, lambda b: b.paused()) == {"sync": "cli"}
    assert main(["resume", "sync", "--url", url]) == 0
    assert store(url, lambda b: b.paused()) == {}
    assert main(["trigger", "sync", "--url", url]) == 0
    out = capsys.readouterr().out
    triggered = int(out.split("sync@", 1)[1].split()[0])
    assert main(["retry", "sync@1000", "--url", url]) == 0
    assert main(["cancel", "sync@3000", "--url", url, "--grace", "1s"]) == 0
    # A grace without a unit is seconds, as the guide writes grace=0.
    assert main(["cancel", f"sync@{triggered}", "--url", url, "--grace", "0"]) == 0
    found = statuses(url)
    assert found[1000] == "handed_over" and found[triggered] == "cancelled"
    assert found[2000] == "completed" and found[3000] == "cancelled"
    history = store(url, lambda b: b.history("sync", 100))
    cancelled = [a for a in history if a.slot == 3000]
    assert [(a.outcome, a.error) for a in cancelled] == [("cancelled", "cancelled by cli")]
    # The retry's attempt, once claimed, says who asked for it in `history` (the text
    # had no column for it; --json had it).
    store(url, lambda b: b.claim(ClaimRequest("sync", 1000, "i-2", "t-again", 30_000)))
    capsys.readouterr()
    assert main(["history", "--url", url, "--job", "sync"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    column = header.index("REQUESTED_BY")
    retried = next(r for r in rows if " i-2 " in r)
    assert retried[column:].split()[0] == "cli", (header, retried)


def test_a_run_queued_by_an_operation_reads_as_queued(
        url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A triggered run not claimed yet, and a retried one: ``status`` says they wait for a
    claim and who asked (it said "attempt 0 handed_over", though nobody handed anything
    over), and a retry of either says why it is refused."""
    run_ending(url, 1000, Outcome.FAILED)
    assert main(["trigger", "sync", "--url", url]) == 0
    triggered = int(capsys.readouterr().out.split("sync@", 1)[1].split()[0])
    assert main(["retry", "sync@1000", "--url", url]) == 0
    capsys.readouterr()
    assert main(["status", "--url", url]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("sync "))
    assert "queued by cli, not claimed yet (handed_over)" in line, line
    assert "attempt 1 by i-1 ended; the next not claimed yet (handed_over" in line, line
    for slot in (triggered, 1000):
        assert main(["retry", f"sync@{slot}", "--url", url]) == 2
        assert "it is handed_over (waiting to be claimed" in capsys.readouterr().err
    # A name with a line break or an escape sequence (who paused it, an instance id)
    # keeps the row one line, and does not act on the terminal.
    store(url, lambda b: Admin(b, by="ops\n\x1b[2Jteam").pause("sync"))
    assert main(["status", "--url", url]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("sync "))
    assert r"paused by ops\n\x1b[2Jteam; slot" in line and "\x1b" not in out, line


def test_refusals_exit_2_and_change_nothing(url: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    run_ending(url, 2000, Outcome.COMPLETED)
    before = statuses(url)
    capsys.readouterr()
    for argv, text in (
            (["trigger", "nope"], "never seen"),
            (["pause", "nope"], "never seen"),
            (["retry", "sync@2000"], "it is completed"),
            (["cancel", "sync@2000"], "already finished"),
            (["retry", "sync@5"], "no run of 'sync'"),
            (["cancel", "sync"], "malformed"),
            (["cancel", "sync@2000", "--grace", "soon"], "grace"),
            (["cancel", "sync@2000", "--grace", "999999h"], "longer than 30 days"),
            (["retry", "sync@²"], "malformed slot"),
            # more digits than int() reads: "unexpected error: ValueError", exit 1
            (["retry", "sync@" + "9" * 5000], "malformed slot"),
            (["resume", "sync"], "it is not paused")):
        assert main([*argv, "--url", url]) == 2, argv
        err = capsys.readouterr().err
        assert f"anarchon {argv[0]}: " in err and text in err, (argv, err)
        assert "Traceback" not in err
    assert statuses(url) == before
    assert store(url, lambda b: b.paused()) == {}


def test_an_operation_on_a_store_that_does_not_exist_creates_none(
        url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A mistyped namespace: the operation exits 3 (no store there), and the store is
    still not there afterwards (status, which never creates one, exits 3 too)."""
    base, _, query = url.partition("?")
    option = query.partition("=")[0]
    missing = f"{base}?{option}=anarchon_t_missing_{uuid.uuid4().hex[:8]}"
    capsys.readouterr()
    for argv in (["pause", "nope"], ["trigger", "nope"], ["retry", "nope@1000"],
                 ["cancel", "nope@1000"]):
        assert main([*argv, "--url", missing]) == 3, argv
        assert "Traceback" not in capsys.readouterr().err
    assert main(["status", "--url", missing]) == 3
