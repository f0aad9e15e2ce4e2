"""`lazy_exports`: a package's public names, imported from their modules on first use (PEP 562).

Lets torch-free modules of a package (e.g. the tier configuration a Hydra plugin reads) be
imported without importing the package's heavy modules.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` loading ``name`` from ``package.<exports[name]>``
    and caching it in ``namespace`` (the package's globals)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    return __getattr__
