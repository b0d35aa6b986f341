"""``python -m lease_core.demo worker URL NAME``: one demo instance, as an OS process.

``bank-worker URL NAME OFFSET_MS`` runs one instance of the bank-close demo.
"""

from __future__ import annotations

import os
import sys

from .fleet import worker_main

if __name__ == "__main__":  # pragma: no cover - worker processes
    if len(sys.argv) == 4 and sys.argv[1] == "worker":
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        worker_main(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 5 and sys.argv[1] == "bank-worker":
        from .bank_close import worker_main as bank_worker

        bank_worker(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit("usage: python -m lease_core.demo worker URL NAME | "
                 "bank-worker URL NAME OFFSET_MS")
