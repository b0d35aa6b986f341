"""``python -m lease_core.demo worker URL NAME NAMESPACE``: one demo instance, as an OS process.

``bank-worker URL NAME OFFSET_MS NAMESPACE`` runs one instance of the bank-close demo.
``NAMESPACE`` names the run's tables or keys (see :mod:`lease_core.demo.namespace`).
``URL`` ``-`` reads the store's URL from ``$ANARCHON_DEMO_URL``, which keeps a password
out of ``ps`` (the demos start their workers so).
"""

from __future__ import annotations

import os
import sys

from .fleet import URL_VARIABLE, worker_main

if __name__ == "__main__":  # pragma: no cover - worker processes
    if len(sys.argv) > 2 and sys.argv[2] == "-":
        sys.argv[2] = os.environ.get(URL_VARIABLE, "")
    if len(sys.argv) == 5 and sys.argv[1] == "worker":
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        worker_main(sys.argv[2], sys.argv[3], sys.argv[4])
    elif len(sys.argv) == 6 and sys.argv[1] == "bank-worker":
        from .bank_close import worker_main as bank_worker

        bank_worker(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
    else:
        sys.exit("usage: python -m lease_core.demo worker URL NAME NAMESPACE | "
                 "bank-worker URL NAME OFFSET_MS NAMESPACE")
