"""Creating or upgrading a PostgreSQL store ahead of the instances: :func:`migrate`
(``anarchon migrate``)."""

from __future__ import annotations

from typing import Any

from .backend import PostgresBackend

__all__ = ["migrate", "migrate_to"]


async def migrate(connection: Any = None, *, table: str | None = None) -> str:
    """Create the store, or upgrade it in place to store code ``CODE_VERSION``.

    ``table`` defaults to the one a DSN names (``?table=``), else ``anarchon_runs``;
    returns the table's name.

    Run it with a privileged user (owner of the tables). Afterwards the application's user
    needs only SELECT, INSERT, UPDATE and DELETE on the tables (EXECUTE on the claim
    functions is granted to PUBLIC; they run with the caller's rights).

    An older store is upgraded with runs in flight: held leases, hand-overs and history
    are kept, the claim function of this release is created beside the old one, and the
    old function's name becomes a call of the new one, so instances of the previous
    release still running claim with the current logic. The attempts an upgrade from
    store code 1 to 3 finds get ``claimed_at`` after its commit, in short transactions of
    10,000: here before returning; after an upgrade by ``start()``, ``FILL_BATCHES``
    batches at each maintenance period, on the instance that wins it. A table lock held
    by a long transaction is waited for at most ``MIGRATION_LOCK_TIMEOUT_MS`` per try.
    Safe to run again, and concurrently; a store of a newer format is refused.
    """
    return (await migrate_to(connection, table=table))[0]


async def migrate_to(connection: Any = None, *, table: str | None = None) -> tuple[str, int]:
    """:func:`migrate`, returning the table's name and the store code the store has now:
    this release's ``CODE_VERSION``, or a newer release's, whose store is used as it is
    (``anarchon migrate`` says which)."""
    backend = PostgresBackend(connection, table=table)
    await backend.start()
    try:
        await backend._store.fill(backend._adapter)
    finally:
        await backend.close()
    return backend.table, backend._store.code
