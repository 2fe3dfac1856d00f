"""Interpreter-start hook, run by `dflash_serve_cpu.pth` when DFLASH_SERVE_CPU=1.

It must run before any sglang import in every process, including the scheduler and
detokenizer children that multiprocessing spawns: SGLang imports `sgl_kernel` at module
level there before it loads plugins. Keep this import-light (no sglang imports).
"""
from __future__ import annotations

import os

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    # SGLang selects its CPU platform from this variable (srt/platforms/__init__.py, utils/common.py is_cpu).
    from sglang_ext import names
    from sglang_ext.cpu import kernels, stubs

    os.environ.setdefault(names.SGLANG_CPU_ENGINE, "1")

    stubs.install()
    kernels.bind()
