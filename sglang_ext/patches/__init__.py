"""Every patch of SGLang 0.5.23 the plugin applies, in one place (docs/ARCHITECTURE.md has the table).

Why here: a patch serves an upstream call site, not a feature; gathering them makes the upstream surface we depend
on reviewable at a glance, and each module says which upstream issue or fix would retire it.

Contract:
  * one module per concern, each with ``install()``; nothing is imported from SGLang at install time -- every
    patch is deferred with ``wrap.when_imported`` and applied with ``wrap.wrap`` (idempotent, ``__wrapped__``);
  * ``install(cpu_active)`` applies the declared list below in order and returns the names applied; it runs
    in every SGLang process (``plugin.register``) after the algorithm is registered;
  * features (worker, controller, metrics) live outside this package and are never patched in from here.
"""
from __future__ import annotations

import importlib

# (module, what it serves) -- applied in this order on every device
ALL_DEVICES: tuple[tuple[str, str], ...] = (
    ("redaction", "API keys out of SGLang's server-args log lines"),
    ("request_validation", "client mistakes that killed the scheduler or answered 500 -> 400"),
    ("penalty_order", "penalties in one order in every process: additive, then scaling"),
    ("verify_sampling", "DFlash verify samples as plain decoding: per-row penalties, min_new_tokens, min_p"),
    ("dflash_headroom", "req_to_token rows wide enough for DFlash's 2-block decode reserve"),
    ("abort_finish", "the worker told of requests the scheduler aborts itself (retraction, queue)"),
    ("plain_decode", "width-1 steps scheduled, run and processed as plain decode steps (non-overlap)"),
    ("capture_finish", "finished requests' token ids to the capture store (learning: on only)"),
    ("drafter_swap", "the worker told when its drafter's weights were replaced (learning hot swap)"),
    ("pause_lease", "a pause or weight-update session whose client is gone ends: draft rolled back, resumed"),
    ("idle_metrics", "idle gauges published on the first idle pass"),
    ("profiler_spans", "the per-step result-copy profiler span only while a profiler records"),
    ("http_guard", "OpenAI-shaped errors, 404/413/415, 503 while draining (dflash-serve only)"),
    ("prompt_shutdown", "exit when the SIGTERM drain is over, not on upstream's next 5-s tick"),
    ("algorithm_name_sites", "name comparisons where DFLASH_ADAPTIVE must answer as DFLASH"),
)
# applied only when the CPU layer is active (DFLASH_SERVE_CPU=1)
CPU_ONLY: tuple[tuple[str, str], ...] = (
    ("cpu_layer", "DFlash on device cpu: server args, attention, sampling, dtype"),
    ("cpu_families", "Gemma 4 and gpt-oss on device cpu: sliding windows and attention sinks in torch_native"),
)

_applied: list[str] = []


def install(cpu_active: bool) -> list[str]:
    """Apply the declared patches once; return the module names applied (CPU patch names listed by cpu_layer)."""
    if _applied:
        return list(_applied)
    for name, _ in ALL_DEVICES + (CPU_ONLY if cpu_active else ()):
        module = importlib.import_module(f"{__name__}.{name}")
        module.install()
        _applied.append(name)
    return list(_applied)
