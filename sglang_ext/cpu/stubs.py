"""Import stubs for `torchvision` and `sgl_kernel`, which SGLang imports at module level.

On CPU neither is usable: no CPU torchvision build is installable next to torch 2.13, and
the PyPI `sgl_kernel` is a CUDA build. SGLang only needs the imports to succeed on the CPU
path; any stub function that is actually *called* raises an error naming the op, so a gap
can never silently compute garbage. Real CPU implementations are bound by `kernels.py`.
"""
from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

STUB_VERSION = "0.0.0+dflash-serve-cpu-stub"
# Only the modules SGLang imports unconditionally on the CPU path are stubbed. Any other
# submodule still raises ImportError, so SGLang's own `try: import ... except ImportError`
# fallbacks keep working (e.g. quantization/utils.py get_scalar_types needs
# `sgl_kernel.scalar_type` to be missing).
_STUBBED_MODULES = {
    "torchvision": (
        "torchvision", "torchvision.transforms", "torchvision.transforms.functional",
        "torchvision.transforms.v2", "torchvision.transforms.v2.functional", "torchvision.io",
        "torchvision.ops", "torchvision.models",
    ),
    "sgl_kernel": (
        "sgl_kernel", "sgl_kernel.utils", "sgl_kernel.kvcacheio", "sgl_kernel.elementwise",
        "sgl_kernel.allreduce", "sgl_kernel.top_k", "sgl_kernel.flash_attn", "sgl_kernel.gemm",
        "sgl_kernel.sampling", "sgl_kernel.speculative", "sgl_kernel.memory", "sgl_kernel.moe",
        "sgl_kernel.mamba",  # gated-delta-net layers (Qwen3.5): their ops are bound by kernels.py
    ),
}


class MissingKernelError(NotImplementedError):
    pass


def _missing(qualname: str):
    def op(*args, **kwargs):
        raise MissingKernelError(
            f"{qualname} was called, but it is a GPU kernel with no CPU implementation in dflash-serve. "
            f"Add a pure-torch version to sglang_ext/cpu/kernels.py, or serve on a GPU."
        )

    op.__name__ = qualname.rsplit(".", 1)[-1]
    op.__qualname__ = qualname
    op.__dflash_stub__ = True
    return op


class InterpolationMode(enum.Enum):
    """torchvision.transforms.InterpolationMode: referenced at import time by SGLang's multimodal utils."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class StubModule(types.ModuleType):
    """A module whose every missing public attribute is a function that raises when called."""

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr == "InterpolationMode" and self.__name__.startswith("torchvision"):
            return InterpolationMode
        fn = _missing(f"{self.__name__}.{attr}")
        setattr(self, attr, fn)
        return fn


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the listed `torchvision` / `sgl_kernel` modules as stub packages."""

    def __init__(self, names: frozenset[str]):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = StubModule(spec.name)
        mod.__path__ = []
        mod.__version__ = STUB_VERSION
        return mod

    def exec_module(self, module):
        parent, _, child = module.__name__.rpartition(".")
        if parent and parent in sys.modules:
            setattr(sys.modules[parent], child, module)


def _really_missing(root: str) -> bool:
    # find_spec does not import the package: a present-but-broken CUDA build is left alone.
    return importlib.util.find_spec(root) is None


def install() -> list[str]:
    """Install stubs for the roots that are not installed. Returns the stubbed roots."""
    if any(isinstance(f, _StubFinder) for f in sys.meta_path):
        return [r for r in _STUBBED_MODULES if isinstance(sys.modules.get(r), StubModule)]
    roots = [r for r in _STUBBED_MODULES if _really_missing(r)]
    if roots:
        sys.meta_path.append(_StubFinder(frozenset(n for r in roots for n in _STUBBED_MODULES[r])))
        for r in roots:
            importlib.import_module(r)
    return list(roots)


def is_stub(module: types.ModuleType) -> bool:
    return isinstance(module, StubModule)
