"""Run a function on a module right after it is first imported (before the importer gets it back), without
importing it early: a finder first on ``sys.meta_path`` that asks the others for the module's spec and wraps its
loader. A module already imported gets the function at once."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: Any, callback: Callback) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        finally:  # the module keeps its own loader
            module.__loader__ = self._loader
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self._loader
        self._callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, get_resource_reader ...
        return getattr(self._loader, name)


class PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callback]] = {}
        self._busy: set[str] = set()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in self.callbacks or name in self._busy:
            return None
        self._busy.add(name)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.discard(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        callbacks = self.callbacks.pop(name)
        spec.loader = _Loader(spec.loader, lambda module: [cb(module) for cb in callbacks])
        return spec


_FINDER: PostImportFinder | None = None


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``name`` is imported (now, if it already is)."""
    global _FINDER
    if name in sys.modules:
        callback(sys.modules[name])
        return
    if _FINDER is None:
        _FINDER = PostImportFinder()
        sys.meta_path.insert(0, _FINDER)
    _FINDER.callbacks.setdefault(name, []).append(callback)
