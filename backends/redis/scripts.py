"""The Lua scripts of the Redis backend (``backends/redis_lua/``) and the limits of a call.

Each script is sent prefixed with ``_prelude.lua`` (and the files of :data:`_INCLUDES`;
the named leases' with ``_lease_prelude.lua``, ``moved.lua`` with none;
``_replid.lua`` where the server's replication id is read),
registered with the driver and run with ``EVALSHA``; :data:`SCRIPTS` holds them by name.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources

__all__ = ["HEARTBEAT_BATCH", "SCRIPTS", "SCRIPT_BATCH", "STORE_FORMAT", "Script"]

#: The store format this version writes; a store with a newer one is refused, an older one
#: (1: every attempt record in the ``{P/E}:att`` hash) is read as it is and marked 2.
STORE_FORMAT = 2

_SCRIPTS = ("open_store", "claim", "claim_many", "heartbeat", "finish", "finish_many",
            "hand_over", "checkpoint", "register", "history", "trim", "held", "members",
            "retry_later", "operate")
#: Files prepended to a script after the prelude (the function it calls).
_INCLUDES = {"claim": ("_claim",), "claim_many": ("_claim",), "finish": ("_finish",),
             "finish_many": ("_finish",), "trim": ("_trim",), "register": ("_replid",),
             "lease_acquire": ("_replid",), "moved": ("_replid",)}
#: Claims per ``claim_many.lua`` call, and finishes per ``finish_many.lua`` call, at most:
#: one script call keeps the server busy, so a large batch goes as several calls (in the
#: same pipeline).
SCRIPT_BATCH = 100
#: The named leases' scripts (backends/redis/named.py), one key each, prefixed with the
#: short ``_lease_prelude.lua`` (the server's clock only).
_LEASE_SCRIPTS = ("lease_acquire", "lease_renew", "lease_release", "lease_read")
#: Scripts sent without a prelude (they need neither the clock nor the helpers).
_BARE_SCRIPTS = ("moved",)

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
    lease_prelude = (folder / "_lease_prelude.lua").read_text(encoding="utf-8")
    scripts = {}
    for name in (*_SCRIPTS, *_LEASE_SCRIPTS, *_BARE_SCRIPTS):
        first = lease_prelude if name in _LEASE_SCRIPTS else prelude
        parts = ([] if name in _BARE_SCRIPTS else [first]) + [
            (folder / f"{part}.lua").read_text(encoding="utf-8")
            for part in (*_INCLUDES.get(name, ()), name)]
        source = "\n".join(parts)
        sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()
        scripts[name] = Script(name, source, sha)
    return scripts


SCRIPTS = _load_scripts()


