"""What differs between the platforms the library runs on (private).

Linux is where the library is tested; macOS and Windows run it too (see the install
page's "Platforms").
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

__all__ = ["asyncio_options"]


def asyncio_options() -> dict[str, Any]:
    """anyio's ``backend_options`` for an asyncio loop the library starts itself (the
    command line's, the sync API's): a selector loop on Windows, whose default
    ``ProactorEventLoop`` psycopg's async connections refuse."""
    if sys.platform == "win32":
        return {"loop_factory": asyncio.SelectorEventLoop}
    return {}
