# ruff: noqa: ARG002
"""A stand-in for nvidia-cutlass-dsl, for the live DeepSeek test only (scripts/sglang_live.sh,
STUB_CUTLASS=1): SGLang 0.5.15's DeepSeek module imports it at module level for Blackwell
kernels that the triton backend on an H200 never runs. Every name resolves to an object
that can be subclassed, decorated with and subscripted; calling it raises."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class _Anything:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._name = str(args[0]) if args and isinstance(args[0], str) else "cutlass"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator: leave the function as it is
        if not args and kwargs:
            return lambda f: f  # a decorator with options
        raise RuntimeError(f"{self._name}: nvidia-cutlass-dsl is a stand-in here")

    def __getitem__(self, key: Any) -> Any:
        return self

    def __iter__(self) -> Any:
        return iter(())

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)  # `class K(cutlass.X)`: a plain class


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.startswith("cutlass."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> Any:
        m = _Module(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module: Any) -> None:
        pass


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _Module
__path__: list[str] = []
