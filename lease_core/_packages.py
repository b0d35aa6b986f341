"""Guard against a foreign ``backends`` or ``adapters`` shadowing anarchon's own packages.

anarchon installs the top-level packages ``backends`` and ``adapters``. A user's own
package or module of the same name earlier on ``sys.path`` (or another distribution that
installs one) would be imported instead, and fail later with a misleading error. Each of
anarchon's packages carries the marker ``__anarchon__ = True``; :func:`require_own`
checks it before anything is imported from the package.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from .errors import ConfigurationError

__all__ = ["OWN_PACKAGES", "require_own"]

#: The top-level packages anarchon installs besides ``lease_core``.
OWN_PACKAGES = ("backends", "adapters")


def _location(module: ModuleType) -> str:
    file = getattr(module, "__file__", None)
    if file:
        return str(file)
    path = list(getattr(module, "__path__", None) or [])
    return ", ".join(map(str, path)) if path else repr(module)


def require_own(name: str) -> ModuleType:
    """Import anarchon's package ``name`` and check that it is anarchon's.

    Raises :class:`ConfigurationError` naming the file that shadows it.
    """
    module = sys.modules.get(name)
    if module is None:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            raise ConfigurationError(
                f"anarchon's package {name!r} is not installed; reinstall anarchon "
                "(pip install --force-reinstall anarchon)"
            ) from None
    if getattr(module, "__anarchon__", False) is not True:
        raise ConfigurationError(
            f"the {name!r} imported from {_location(module)} is not anarchon's {name!r} "
            f"package and shadows it; rename that package or module (or take its directory "
            f"off sys.path), or uninstall the distribution that installs it"
        )
    return module
