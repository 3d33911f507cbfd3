"""A package's public names imported on first use (PEP 562 ``__getattr__``), so that importing one of its
light modules does not pay for torch or torchrec."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """The package's ``__getattr__``: ``exports`` maps a name to the module that defines it, relative to
    ``package`` or, with a dot in it, absolute."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        full = module if "." in module else f"{package}.{module}"
        return getattr(importlib.import_module(full), name)

    return __getattr__
