"""Does torch.compile pay for the DFlash draft forward on CPU? Step time through real servers, side by side.

The draft forward of a width-16 step is ~4.5 ms at one request on the bundled pair (~2.2 ms of it matmuls, the rest
per-op overhead: benchmarks/results/step_profile_cpu.md), the kind of cost torch.compile (inductor: fused C++
kernels) removes where it can trace a whole region. SGLang's draft layer is not one pure-tensor region: its attention
goes through the attention backend's Python and writes the KV pool. Three servers held at width 16 by the controller's
`fixed` mode, measured in turns (benchmarks/step_time.py's step time, median of --repeats):
  eager   the product as shipped;
  layer   every draft decoder layer's forward compiled (dynamic shapes; whatever Dynamo cannot trace runs eagerly);
  mlp     only the draft layers' MLPs and their two RMSNorms compiled (regions with no break).
The compile is applied in the server processes by a `sitecustomize` on their PYTHONPATH (Python imports it at
start-up) that wraps SGLang's classes once `sglang.srt.models.dflash` is imported: nothing in the product changes.

    python benchmarks/draft_compile.py [--loads 1 16] [--repeats 3]

Prints a markdown table and writes JSON (benchmarks/results/draft_compile_cpu.json).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.step_profile import config_for  # noqa: E402
from benchmarks.step_time import measure, prompts, timed  # noqa: E402
from harness.server import ManagedServer  # noqa: E402

SITECUSTOMIZE = '''
import os
if os.environ.get("DFLASH_BENCH_COMPILE"):
    from sglang_ext.patches.wrap import when_imported

    def _compile(module):
        import torch
        how = os.environ["DFLASH_BENCH_COMPILE"]
        if how not in ("layer", "mlp"):
            raise ValueError(f"DFLASH_BENCH_COMPILE={how!r}: expected layer or mlp")
        init = module.DFlashDecoderLayer.__init__

        def compiled_init(self, *args, **kwargs):  # per instance: the target's RMSNorms stay eager
            init(self, *args, **kwargs)
            if how == "layer":
                self.forward = torch.compile(self.forward, dynamic=True)
            else:
                self.mlp.forward = torch.compile(self.mlp.forward, dynamic=True)
                for norm in (self.input_layernorm, self.post_attention_layernorm):
                    norm.forward_native = torch.compile(norm.forward_native, dynamic=True)

        module.DFlashDecoderLayer.__init__ = compiled_init

    when_imported("sglang.srt.models.dflash", _compile)
'''
VARIANTS = {"eager": None, "layer": "layer", "mlp": "mlp"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=REPO / "deploy/configs/cpu.yaml", help="base server config")
    p.add_argument("--loads", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/draft_compile_cpu.json")
    a = p.parse_args(argv)
    vocab = json.loads((Path(config_for(a.config, "adaptive-w16")["model"]["path"]) / "config.json").read_text())[
        "vocab_size"]
    results: dict[str, dict] = {"loads": {}, "warmup_s": {}}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        site = Path(tmp) / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        servers = {}
        for name, how in VARIANTS.items():
            env = {"PYTHONPATH": f"{site}:{REPO}"} | ({"DFLASH_BENCH_COMPILE": how} if how else {})
            server = stack.enter_context(ManagedServer(config_for(a.config, "adaptive-w16"), Path(tmp), name,
                                                       env=env, startup_timeout=900))
            t = time.perf_counter()
            for n in sorted(set(a.loads)):  # the compile (and any recompile for a new batch size) happens here
                timed(server, prompts(vocab, 64, n, 0), 8)
            results["warmup_s"][name] = time.perf_counter() - t
            servers[name] = server
            print(f"[compile] {name}: warm-up {results['warmup_s'][name]:.1f} s", file=sys.stderr, flush=True)
        for n in a.loads:
            ids = prompts(vocab, a.context, n, seed=n)
            runs: dict[str, list[float]] = {k: [] for k in servers}
            for _ in range(a.repeats):
                for k, server in servers.items():
                    runs[k].append(measure(server, ids, a.new_tokens, 1, True)["step_ms"])
            results["loads"][str(n)] = {k: {"step_ms": statistics.median(v), "step_ms_all": v}
                                        for k, v in runs.items()}
    print("| requests | " + " | ".join(f"{k} ms" for k in VARIANTS) + " | layer / eager | mlp / eager |")
    print("|---:|" + "---:|" * (len(VARIANTS) + 2))
    for n, row in results["loads"].items():
        ms = [row[k]["step_ms"] for k in VARIANTS]
        print(f"| {n} | " + " | ".join(f"{x:.2f}" for x in ms) + f" | {ms[1] / ms[0]:.2f} | {ms[2] / ms[0]:.2f} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"context": a.context, "new_tokens": a.new_tokens, "repeats": a.repeats,
                                 "variants": list(VARIANTS), **results}, indent=2) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
