"""``python -m lease_core.demo worker URL NAME``: one demo instance, as an OS process."""

from __future__ import annotations

import os
import sys

from .fleet import worker_main

if __name__ == "__main__":  # pragma: no cover - worker processes
    if len(sys.argv) == 4 and sys.argv[1] == "worker":
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        worker_main(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python -m lease_core.demo worker URL NAME")
