"""The two primitives every patch of SGLang uses: defer until a module is imported, and wrap an attribute once.

`when_imported(name, callback)`: run a function when a module is first imported (or now, if it already is).
`wrap(owner, name, make)`: replace `owner.name` by `make(original)`, once (idempotent), with `__wrapped__` set so
`inspect.unwrap` and the name-site audit reach upstream's source.

Patching SGLang modules from `register()` must not import them: register() runs in the
main process before arg parsing and before SGLang sets PROMETHEUS_MULTIPROC_DIR, and
importing e.g. the model runner there would pull in prometheus_client too early (its value
class is fixed at import) and cost seconds. SGLang's HookRegistry resolves targets eagerly,
so we defer with a meta-path finder that wraps the module's loader.
"""
from __future__ import annotations

import importlib.abc
import sys
import threading
from collections import defaultdict
from types import ModuleType
from typing import Any, Callable

_pending: dict[str, list[Callable[[ModuleType], None]]] = defaultdict(list)
_lock = threading.RLock()


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _run(module.__name__, module)

    def __getattr__(self, name):  # get_source, is_package, ... for tracebacks and inspect
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


_finder = _Finder()


def _run(name: str, module: ModuleType) -> None:
    with _lock:
        callbacks = _pending.pop(name, [])
    for cb in callbacks:
        cb(module)


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call `callback(module)` once module `name` is imported; immediately if it already is."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _pending[name].append(callback)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return
    callback(module)


MARK = "__dflash_serve_patch__"


def wrap(owner: Any, name: str, make: Callable[[Any], Callable]) -> Callable:
    """Set ``owner.name = make(original)`` unless it is already our wrapper; return what is installed.

    The wrapper carries ``__wrapped__ = original`` (upstream's object, for callers that must bypass us and for
    ``inspect.unwrap``) and a marker that makes a second call a no-op (``register()`` runs in every process, and a
    module may be patched through two import paths)."""
    original = getattr(owner, name)
    if getattr(original, MARK, False):
        return original
    wrapper = make(original)
    wrapper.__wrapped__ = original  # the wrapper keeps its own __module__/__name__: tracebacks show it is ours
    setattr(wrapper, MARK, True)
    setattr(owner, name, wrapper)
    return wrapper
