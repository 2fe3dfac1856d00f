"""Where a decode step's time goes, through real servers: step time measured, then split by py-spy samples.

For each configuration (no-spec; upstream DFlash block 16; dflash_adaptive held at verify width 1, 4 and 16 by
the controller's `fixed` mode, and choosing for itself; on demand upstream block 8, adaptive width 8, and widths 4
and 8 drafting the full block, `-full`, where the CPU default drafts only the verified positions) and each load
(1 and 16 concurrent requests):
  1. step time: the same random prompts run for 1 and for N new tokens (greedy, EOS ignored, radix cache off);
     step = (t_N - t_1) / decode steps, as benchmarks/step_time.py (its helpers); every server runs at once and
     they are measured in turns, the median of --repeats rounds;
  2. profile: `py-spy record` samples the scheduler process (`sglang::scheduler`) while the same load loops; each
     sample is charged to the first phase below whose marker is on its stack (innermost phases first), and a
     phase's milliseconds per step = its share of the samples x the step time.

With --prefill-seconds, the first token is profiled too: the same prompts answered with one token each, its time
(the batch's TTFT) split into the same phases (the drafter's prompt context is "draft-KV append").

Phases: draft forward, verify/decode forward (the target), accept/sample, draft-KV append, window/prepare (the
step's KV window, the verify input, the scheduler's per-step reservation), controller+metrics (our loop),
result processing (the scheduler's), scheduler other (the rest of the event loop: batching, I/O). py-spy drops
samples of a sleeping thread, so shares are of the scheduler's busy time (at steady load it does not wait).

    python benchmarks/step_profile.py [--loads 1 16] [--configs no-spec adaptive-w1] [--seconds 10]
    python benchmarks/step_profile.py --context 256 --loads 1 8 32 --prefill-seconds 6   # + the first token's phases
    git worktree add /tmp/before HEAD~3 && python benchmarks/step_profile.py --before /tmp/before   # before/after

`--before DIR` adds `NAME@before` for every adaptive configuration: the same server run from the checkout DIR (its
PYTHONPATH), measured in the same turns, so a change's before/after table is one run's.

Prints one markdown table per load and writes JSON. Needs py-spy (pip install py-spy) and ptrace rights.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.step_time import measure, prompts, server_config, timed  # noqa: E402
from harness.server import ManagedServer  # noqa: E402
from sglang_ext import names  # noqa: E402

# (phase, frame-name markers): a sample goes to the first phase with a marker on its stack, so nested phases
# (the target forward inside the worker's verify, the sampler inside the forward) come before their callers
PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tree build/walk", ("tree/build.py", "tree/mask.py", "tree/walk.py", "tree/commit.py", "marginals")),
    ("draft forward", ("draft_forward", "DFlashWorkerV2._run_draft", "DFlashWorkerV2._draft")),
    ("draft-KV append", ("_append_target_hidden_to_draft_kv", "DraftKV.flush")),
    ("accept/sample", ("_accept_block", "Sampler.forward", "accept_width1", "target_choices")),
    ("verify/decode forward", ("TpModelWorker.forward_batch_generation",)),
    ("window/prepare", ("block_window", "prepare_for_verify", "prepare_for_decode", "_prepare_dflash_draft_block",
                        "width1_window", "wide_window")),
    ("controller+metrics", ("ControllerLoop.", "DFlashMetrics.", "BlockSizeController.")),
    ("result processing", ("Scheduler.process_batch_result",)),
    ("scheduler other", ("Scheduler.",)),
)
PHASE_NAMES = [p for p, _ in PHASES] + ["other"]

CONFIGS = {
    "no-spec": {"speculative": {"algorithm": "none"}},
    "dflash-b16": {"speculative": {"algorithm": "dflash", "block_size": 16}},
    "adaptive-w1": {"speculative": {"algorithm": "dflash_adaptive", "adaptive": {"mode": "fixed", "fixed_block": 1}}},
    "adaptive-w4": {"speculative": {"algorithm": "dflash_adaptive", "adaptive": {"mode": "fixed", "fixed_block": 4}}},
    "dflash-b8": {"speculative": {"algorithm": "dflash", "block_size": 8}},  # upstream drafting 8 positions
    "adaptive-w8": {"speculative": {"algorithm": "dflash_adaptive", "adaptive": {"mode": "fixed", "fixed_block": 8}}},
    "adaptive-w16": {"speculative": {"algorithm": "dflash_adaptive",
                                     "adaptive": {"mode": "fixed", "fixed_block": 16}}},
    "adaptive": {"speculative": {"algorithm": "dflash_adaptive"}},  # the controller's own choice (defaults)
    # the same without probes: what probing costs where drafts are never accepted
    "adaptive-no-probes": {"speculative": {"algorithm": "dflash_adaptive", "adaptive": {"probe_interval": 0}}},
    # per-request widths: every step of 2+ requests ragged, alternate requests at 16 and 1 (mean width 8.5)
    "adaptive-ragged": {"speculative": {"algorithm": "dflash_adaptive",
                                        "adaptive": {"mode": "cycle", "candidates": [1, 16], "cycle_pattern": [16, 1],
                                                     "per_request_widths": True}}},
    # DDTree: every step a tree of 16 or 31 draft prefixes (verify width 17 or 32: above the drafter's block)
    "adaptive-tree16": {"speculative": {"algorithm": "dflash_adaptive",
                                        "adaptive": {"mode": "fixed", "candidates": [16, 17], "fixed_block": 17}}},
    "adaptive-tree31": {"speculative": {"algorithm": "dflash_adaptive",
                                        "adaptive": {"mode": "fixed", "candidates": [16, 32], "fixed_block": 32}}},
    # width 1 with trees among the candidates (cpu-tree.yaml's): what the adaptive shape pays while off on prose
    "adaptive-w1-trees": {"speculative": {"algorithm": "dflash_adaptive", "adaptive": {
        "mode": "fixed", "candidates": [1, 2, 4, 8, 16, 32, 64], "fixed_block": 1}}},
}
# the same width drafting the full block on CPU too (as on GPU): the reference prefix drafts are measured against
FULL_DRAFTS = {names.FULL_DRAFTS: "1"}
for _w in (4, 8):
    CONFIGS[f"adaptive-w{_w}-full"] = CONFIGS[f"adaptive-w{_w}"]
ENV = {"adaptive-w4-full": FULL_DRAFTS, "adaptive-w8-full": FULL_DRAFTS}
ON_DEMAND = ("adaptive-no-probes", "dflash-b8", "adaptive-w8", "adaptive-w4-full", "adaptive-w8-full",
             "adaptive-tree16", "adaptive-tree31",
             "adaptive-ragged", "adaptive-w1-trees")


BEFORE = "@before"


def is_speculative(name: str) -> bool:
    return CONFIGS[name.removesuffix(BEFORE)]["speculative"]["algorithm"] != "none"


def config_for(base: Path, name: str) -> dict:
    cfg = server_config(base, speculative=True)
    spec = dict(cfg["speculative"])
    override = CONFIGS[name]["speculative"]
    if override["algorithm"] == "none":
        spec = {"algorithm": "none"}
    else:
        spec.pop("block_size", None)
        spec.update(override)
    cfg["speculative"] = spec
    return cfg


def phase_of(frames: list[str]) -> str:
    """The phase a sample's stack (outermost first) is charged to."""
    if not any("Scheduler." in f for f in frames):
        return "other"
    for phase, markers in PHASES:
        if any(m in f for f in frames for m in markers):
            return phase
    return "other"


def parse_raw(text: str) -> Counter:
    """py-spy's raw (collapsed) format, one `frame;frame;... count` per line -> samples per phase."""
    out: Counter = Counter()
    for line in text.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = [re.sub(r" \(.*", "", f).strip() for f in stack.split(";")]
        out[phase_of(frames)] += int(n)
    return out


def scheduler_pid(server: ManagedServer) -> int:
    """The scheduler child of this server (SGLang names it `sglang::scheduler`)."""
    found = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    todo = list(found)
    while todo:  # the launcher's child is `sglang serve`; the scheduler is further down
        pid = todo.pop()
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        if "sglang::scheduler" in title:
            return int(pid)
        todo += subprocess.run(["pgrep", "-P", pid], capture_output=True, text=True).stdout.split()
    raise RuntimeError(f"no sglang::scheduler process under the server (pid {server.proc.pid})")


def profile(server: ManagedServer, ids, new_tokens: int, seconds: float, rate: int,
            keep: Path | None = None, temperature: float = 0.0) -> Counter:
    """py-spy samples of the scheduler while `ids` loop through the server (raw stacks copied to `keep`)."""
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            timed(server, ids, new_tokens, temperature)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    time.sleep(1.0)  # into steady decoding
    text = record_scheduler(server, seconds, rate, keep)
    stop.set()
    worker.join()
    return parse_raw(text)


def record_scheduler(server: ManagedServer, seconds: float, rate: int, keep: Path | None = None) -> str:
    """`py-spy record` of the server's scheduler process for `seconds`: its raw stacks (also copied to `keep`)."""
    with tempfile.NamedTemporaryFile(suffix=".txt") as raw:
        subprocess.run(["py-spy", "record", "--pid", str(scheduler_pid(server)), "--rate", str(rate),
                        "-d", str(int(seconds)), "--format", "raw", "-o", raw.name, "--nonblocking"],
                       check=True, capture_output=True)
        text = Path(raw.name).read_text()
    if keep is not None:
        keep.parent.mkdir(parents=True, exist_ok=True)
        keep.write_text(text)
    return text


def phase_table(title: str, total: str, extra: str, rows: dict[str, tuple[float, str, dict]], digits: int = 2) -> str:
    """A markdown table: per configuration its total (`total` column; x no-spec's), one `extra` column and the
    phases. ``rows``: name -> (total, extra cell, {phase: value})."""
    head = ["config", total, "x no-spec", extra] + PHASE_NAMES
    out = [title, "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    plain = rows["no-spec"][0] if "no-spec" in rows else None
    for name, (tot, cell, phases) in rows.items():
        ratio = f"{tot / plain:.2f}" if plain else "-"
        out.append("| " + " | ".join([name, f"{tot:.{digits}f}", ratio, cell]
                                     + [f"{phases.get(p, 0.0):.{digits}f}" for p in PHASE_NAMES]) + " |")
    return "\n".join(out)


def table(load: int, rows: dict[str, dict]) -> str:
    return phase_table(f"#### {load} concurrent request(s): ms per decode step by phase", "step ms", "accept",
                       {name: (r["step_ms"], f"{r.get('accept_length', 1.0):.2f}", r["phase_ms"])
                        for name, r in rows.items()})


def prefill_table(load: int, rows: dict[str, dict]) -> str:
    return phase_table(f"#### {load} concurrent request(s): ms to the first token (the batch's prefill) by phase",
                       "first token ms", "step ms", {name: (r["first_token_ms"], f"{r['step_ms']:.2f}",
                                                            r.get("prefill_phase_ms", {}))
                                                     for name, r in rows.items()})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=REPO / "deploy/configs/cpu.yaml", help="base server config")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS),
                   default=[c for c in CONFIGS if c not in ON_DEMAND],  # 6 servers fit 24 GiB
                   help="on demand: upstream block 8, adaptive width 8, and widths 4 and 8 drafting the full block "
                        "(-full; the CPU default drafts only the verified positions)")
    p.add_argument("--loads", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (0: greedy; 1: the sampled accept and sampler)")
    p.add_argument("--repeats", type=int, default=5, help="step-time measurements per point, taken in turns")
    p.add_argument("--seconds", type=float, default=10, help="py-spy recording per point")
    p.add_argument("--rate", type=int, default=400, help="py-spy samples per second")
    p.add_argument("--prefill-seconds", type=float, default=0,
                   help="also profile the first token alone (prompts prefilled, one token answered) this long")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/step_profile_cpu.json")
    p.add_argument("--before", type=Path, default=None, metavar="DIR",
                   help="also run the adaptive configurations from this checkout (NAME@before), side by side")
    p.add_argument("--raw-dir", type=Path, default=None,
                   help="keep py-spy's raw stacks here (CONFIG_uLOAD.txt; flamegraph.pl or speedscope read them)")
    a = p.parse_args(argv)
    if shutil.which("py-spy") is None:
        p.error("py-spy is not installed: pip install py-spy")

    vocab = json.loads((Path(server_config(a.config, True)["model"]["path"]) / "config.json").read_text())["vocab_size"]
    results: dict[str, dict[str, dict]] = {str(n): {} for n in a.loads}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        # every server up at once, measured in turns (config A, B, ..., A, B, ...): this machine drifts by 10-20 %
        # over minutes, so step times taken one server after another would compare the drift, not the configs
        servers = {}
        names = list(a.configs)
        if a.before is not None:
            names += [f"{n}{BEFORE}" for n in a.configs if n.startswith("adaptive")]
        for ci, name in enumerate(names, 1):
            print(f"[profile] {ci}/{len(names)} starting {name}", file=sys.stderr, flush=True)
            env = dict(ENV.get(name.removesuffix(BEFORE), {}))
            if name.endswith(BEFORE):
                env["PYTHONPATH"] = str(a.before.resolve())
            server = ManagedServer(config_for(a.config, name.removesuffix(BEFORE)), Path(tmp),
                                   name.replace("@", "-"), env=env or None,
                                   cwd=a.before.resolve() if name.endswith(BEFORE) else None)
            servers[name] = stack.enter_context(server)
            timed(servers[name], prompts(vocab, 64, 1, 0), 8)  # warm-up
        for n in a.loads:
            ids = prompts(vocab, a.context, n, seed=a.context * 100 + n)
            runs: dict[str, list[dict]] = {name: [] for name in servers}
            for _ in range(a.repeats):
                for name, server in servers.items():
                    runs[name].append(measure(server, ids, a.new_tokens, 1, is_speculative(name), a.temperature))
            for name, server in servers.items():
                r = {"step_ms": statistics.median(x["step_ms"] for x in runs[name]),
                     "step_ms_all": [x["step_ms"] for x in runs[name]],
                     "first_token_ms": statistics.median(x["first_token_ms"] for x in runs[name]),
                     "first_token_ms_all": [x["first_token_ms"] for x in runs[name]]}
                if is_speculative(name):
                    r["accept_length"] = statistics.mean(x["accept_length"] for x in runs[name])
                samples = profile(server, ids, a.new_tokens, a.seconds, a.rate,
                                  a.raw_dir / f"{name}_u{n}.txt" if a.raw_dir else None, a.temperature)
                busy = sum(samples.values()) or 1
                r["samples"] = dict(samples)
                r["phase_ms"] = {ph: r["step_ms"] * samples.get(ph, 0) / busy for ph in PHASE_NAMES}
                if a.prefill_seconds > 0:  # the first token alone: the prefill's phases (draft-KV append: the
                    # drafter's prompt context)
                    pre = profile(server, ids, 1, a.prefill_seconds, a.rate,
                                  a.raw_dir / f"{name}_u{n}_prefill.txt" if a.raw_dir else None, a.temperature)
                    r["prefill_samples"] = dict(pre)
                    busy = sum(pre.values()) or 1
                    r["prefill_phase_ms"] = {ph: r["first_token_ms"] * pre.get(ph, 0) / busy for ph in PHASE_NAMES}
                results[str(n)][name] = r
                print(f"[profile] {name}, {n} request(s): {r['step_ms']:.2f} ms/step", file=sys.stderr, flush=True)
    for n in a.loads:
        print(table(n, results[str(n)]) + "\n")
        if a.prefill_seconds > 0:
            print(prefill_table(n, results[str(n)]) + "\n")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"context": a.context, "new_tokens": a.new_tokens, "temperature": a.temperature,
                                 "repeats": a.repeats,
                                 "seconds": a.seconds, "prefill_seconds": a.prefill_seconds, "rate": a.rate, "phases": PHASE_NAMES,
                                 "loads": results}, indent=2) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
