"""``mypyc_attr``, the class options of the optional compiled build (``computron._fast``), without
needing mypy at run time: where ``mypy_extensions`` is not installed it is a decorator that does
nothing (mypyc reads these options when it compiles; a pure-Python run never needs them)."""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")

try:
    from mypy_extensions import mypyc_attr
except ImportError:  # pure Python: nothing to tell a compiler
    def mypyc_attr(*attrs: str, **kwattrs: object) -> Callable[[T], T]:  # type: ignore[no-redef]
        def keep(x: T) -> T:
            return x
        return keep

__all__ = ["mypyc_attr"]
