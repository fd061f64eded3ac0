"""Names of a package imported from its submodules on first use (PEP 562), so that importing the package stays
cheap and optional dependencies load only with the names that need them."""

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping


def lazy_exports(
    package: str, module_of: Mapping[str, str], public: Iterable[str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The package's `__getattr__` and `__dir__`: each name of `module_of` is read from the submodule it maps to
    (relative to `package`) and cached on the package; `dir()` lists `public`."""
    public = sorted(public)

    def __getattr__(name: str):
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module_of[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return public

    return __getattr__, __dir__
