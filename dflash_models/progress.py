"""One-line progress reports (step, loss, tokens/s, ETA) for long CPU jobs, and thread setup."""
from __future__ import annotations

import os
import sys
import time


def single_thread(threads: int = 1) -> None:
    """Pin torch to `threads` threads. On a small shared machine more threads than free cores
    make OpenMP spin: a 2-thread matmul on 2 busy cores ran 60x slower than a 1-thread one."""
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # already set in this process
        pass


def fmt_secs(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """`every` steps prints: [tag] step i/n | key value ... | tok/s | elapsed | eta."""

    def __init__(self, tag: str, total: int, every: int = 10, stream=None):
        self.tag, self.total, self.every = tag, total, every
        self.stream = stream or sys.stdout
        self.t0 = time.perf_counter()
        self.tokens = 0

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def update(self, step: int, tokens: int = 0, force: bool = False, **values) -> None:
        self.tokens += tokens
        if not (force or step % self.every == 0 or step == self.total):
            return
        el = self.elapsed
        eta = el / max(step, 1) * (self.total - step)
        vals = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
        rate = f" | {self.tokens / max(el, 1e-9):,.0f} tok/s" if self.tokens else ""
        print(f"[{self.tag}] {step}/{self.total} | {vals}{rate} | {fmt_secs(el)} elapsed | eta {fmt_secs(eta)}",
              file=self.stream, flush=True)
