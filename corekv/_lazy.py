"""Names a package exports but imports only on first use (PEP 562 module ``__getattr__``)."""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, name_to_module: Mapping[str, str]) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``package`` that imports ``name_to_module[name]`` on first access and
    caches the value in the package. A name equal to its module's last component is the module."""

    def __getattr__(name: str) -> Any:
        module_name = name_to_module.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(module_name)
        value = module if module_name.endswith("." + name) else getattr(module, name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
