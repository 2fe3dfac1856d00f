"""CPU compatibility layer: lets SGLang's own code path serve on a plain x86 CPU.

Nothing here runs unless `DFLASH_SERVE_CPU=1` is set (the launcher sets it for
`device: cpu`). Two entry points:
  * `startup.install()` -- run at interpreter start by the shipped `.pth` hook, before any
    sglang import, because the import stubs must exist before SGLang's module-level imports
    in the spawned scheduler/detokenizer processes (plugins load too late there);
  * `patches.install()` -- run from the plugin's `register()`: runtime patches of SGLang call
    sites, each named for the call site it serves.
"""
from __future__ import annotations

import os

from sglang_ext import names as env


def is_active() -> bool:
    return os.environ.get(env.CPU) == "1"
