"""A drafter that learns the traffic it serves, side by side under Locust: two servers of one config on a workload the
bundled pair was not trained on, one learning (`learning:` on, `dflash-serve learn loop` beside it) and one not.

Workloads (`--workload`):
  realcode  real-world code from this machine's installed packages (site-packages sources: the pair was trained on
            the stdlib only), code prefixes and chat prompts cut as the pair's own training prompts are, greedy
  prose     chat prose (a task about a topic: stories, letters, explanations), temperature 1

Both servers get the same prompts in the same order (one Locust process each, `--prompt-order sequence`, `--users`
closed-loop users, fresh prompts for the whole run, none repeated) for `--minutes`. Every `--window` seconds each
server's /metrics are read: the acceptance length it served (1 + accepted / verify steps: what the controller's
widths made of the drafter) and the drafter's own acceptance at its full block from the per-position counters
(1 + sum_k prod_{j<=k} p_j, p_j = accepted / tried at position j: the width-independent figure, the one the gate
measures offline), and output tokens/s. After `--minutes`, both are measured on the pair's original mix (prompts from
the held-out stdlib files, greedy). The learner's promotions and refusals (its decision log) are in the JSON and on
the plot.

    python benchmarks/learning_ab.py [--workload realcode|prose] [--minutes 30] [--window 60] [--users 3]
        [--temperature T] [--algorithm dflash_adaptive|dflash] [--learn-steps 40] [--min-sequences 96]
        [--out benchmarks/results/learning_ab_<workload>[_t<T>]_cpu.json]

Prints a markdown table, writes JSON and a PNG next to it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.server import ManagedServer  # noqa: E402
from loadtest import server_metrics  # noqa: E402

ADMIN_ENV, ADMIN = "DFLASH_LEARN_BENCH_ADMIN", "learn-bench-admin-key"
CHAT = REPO / "loadtest" / "chat.py"
TEMPERATURE = {"realcode": 0.0, "prose": 1.0}


def site_packages_files() -> list[Path]:
    import sysconfig

    root = Path(sysconfig.get_paths()["purelib"])
    skip = {"tests", "test", "__pycache__", "sglang", "torch", "transformers"}  # huge trees; the rest is plenty
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)
                  and 2_000 < p.stat().st_size < 200_000)[:4000]


TOPICS = ("a lighthouse keeper", "a city at night", "the first day of school", "a lost dog", "an old bakery",
          "a mountain village", "a train journey", "a thunderstorm", "a chess tournament", "a garden in spring",
          "a letter never sent", "a small bookshop", "the ocean at dawn", "a broken clock", "a jazz musician",
          "a winter market", "a bicycle repair shop", "an abandoned house", "a river crossing", "a school play",
          "a night shift nurse", "a street food stall", "a desert road", "a family recipe", "a football final",
          "a violin teacher", "an astronaut's return", "a forest fire", "a quiet library", "a wedding in the rain",
          "a fishing boat", "a power cut", "a museum guard", "a kite festival", "a moving day", "a lost wallet",
          "a beekeeper", "a snowed-in cabin", "a retired detective", "a new neighbour")
TASKS = ("Write a short story about {t}.", "Describe {t} to someone who has never seen it.",
         "Write a letter to a friend about {t}.", "Write a poem about {t}.", "Explain why people remember {t}.",
         "Write the opening paragraph of a novel about {t}.", "Write a diary entry about {t}.",
         "Give three warm paragraphs about {t}.", "Tell a children's bedtime story about {t}.",
         "Write a news report about {t}.", "Describe the sounds and smells of {t}.",
         "Write a dialogue between two people about {t}.", "Write a postcard from {t}.",
         "Summarise a day spent with {t}.", "Write a speech that mentions {t}.")
STYLES = ("", " Keep it short.", " Write it for a child.", " Use a formal tone.", " Make it funny.")


def dataset(workload: str, n: int, seed: int) -> list[dict]:
    """Locust dataset lines: `n` distinct prompts of the workload, shuffled deterministically."""
    if workload == "prose":
        lines = [{"messages": [{"role": "user", "content": task.format(t=t) + style}]}
                 for t in TOPICS for task in TASKS for style in STYLES]
        random.Random(seed).shuffle(lines)
        return lines[:n]
    from dflash_models import corpus, data

    files = site_packages_files() if workload == "realcode" else corpus.split_files(corpus.stdlib_files()).heldout
    texts, seen = [], set()
    for p in data.prompts(files, n * 2, seed):
        if p.text not in seen:  # fresh prompts only: a repeat would let the learner memorise the gate's slice
            seen.add(p.text)
            texts.append({"prompt": p.text})
    return texts[:n]


def _by_position(snap, name: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for labels, v in (snap or {}).get(name, []):
        if "position" in labels:
            k = int(labels["position"])
            out[k] = out.get(k, 0.0) + v
    return out


def window(before: dict, after: dict, seconds: float, min_tried: int = 20) -> dict:
    """What one server did between two scrapes: served acceptance length, the drafter's full-block acceptance (None
    when its first position was tried fewer than `min_tried` times in the window), output tokens/s, swaps so far."""
    def d(name: str) -> float:
        return (server_metrics.total(after, name) or 0.0) - (server_metrics.total(before, name) or 0.0)

    steps, accepted = d("dflash_verify_steps_total"), d("dflash_accepted_tokens_total")
    acc_a, acc_b = (_by_position(s, "dflash_accepted_tokens_by_position_total") for s in (before, after))
    tri_a, tri_b = (_by_position(s, "dflash_tried_tokens_by_position_total") for s in (before, after))
    # Positions tried fewer than `min_tried` times end the sum (their share is the product of every earlier p_j:
    # small where few drafts reach them); the first position must have its tries.
    # The sum is the full block's only where every position was tried: the adaptive controller reaches the deep
    # positions only at wide widths, and right after a drafter swap (its acceptance priors reset) it may serve
    # narrower widths for a while -- then the sum stops early and reads low whatever the drafter. `block_positions`
    # says how many positions it holds: two figures are comparable only at the same count.
    block, run, ok, depth = 1.0, 1.0, False, 0
    for k in sorted(tri_b):
        tried = tri_b[k] - tri_a.get(k, 0.0)
        if tried < min_tried:
            break
        ok, depth = True, depth + 1
        run *= (acc_b.get(k, 0.0) - acc_a.get(k, 0.0)) / tried
        block += run
    if steps:
        served = round(1 + accepted / steps, 3)
    else:  # upstream's dflash worker exports no dflash_* counters: SGLang's own (tokens per verify call)
        calls = d("sglang:spec_verify_calls_total")
        served = round(d("sglang:generation_tokens_total") / calls, 3) if calls else None
    return {"acceptance": served, "drafter_block_acceptance": round(block, 3) if ok else None,
            "block_positions": depth,
            "tokens_per_s": round(d("sglang:generation_tokens_total") / seconds, 1),
            "swaps": int(server_metrics.total(after, "dflash_drafter_swaps_total") or 0)}


def locust(url: str, data: Path, users: int, seconds: float, temperature: float, max_new: int, stem: Path):
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_SERVE_CPU"}
    cmd = [sys.executable, "-m", "locust", "-f", str(CHAT), "--headless", "--only-summary", "-u", str(users),
           "-r", str(users), "--host", url, "-t", f"{int(seconds)}s", "--dataset", str(data), "--prompt-order",
           "sequence", "--max-tokens", str(max_new), "--temperature", str(temperature), "--max-failure-ratio", "0",
           "--summary-file", f"{stem}_summary.json", "--csv", str(stem)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(f"{stem}_locust.log", "w"), stderr=subprocess.STDOUT)


def run_phase(servers: dict[str, ManagedServer], data: Path, users: int, seconds: float, temperature: float,
              max_new: int, every: float, raw: Path, name: str, on_window=None) -> tuple[list[dict], dict]:
    """Locust against every server at once for `seconds`; a row of per-server windows every `every` seconds."""
    procs = {k: locust(s.url, data, users, seconds, temperature, max_new, raw / f"{name}_{k}")
             for k, s in servers.items()}
    t0 = time.monotonic()
    prev = {k: server_metrics.scrape(s.url) for k, s in servers.items()}
    prev_t, rows = t0, []
    while any(p.poll() is None for p in procs.values()):
        time.sleep(max(0.0, min(every - (time.monotonic() - prev_t), 5.0)))
        if time.monotonic() - prev_t < every and any(p.poll() is None for p in procs.values()):
            continue
        now = time.monotonic()
        if now - prev_t < every / 2 and rows:  # Locust's last seconds (users stopping): too short to read
            break
        snap = {k: server_metrics.scrape(s.url) for k, s in servers.items()}
        row = {"minute": round((now - t0) / 60, 2), **{k: window(prev[k], snap[k], now - prev_t) for k in servers}}
        rows.append(row)
        if on_window:
            on_window(row)
        prev, prev_t = snap, now
    results = {}
    for k in servers:
        p = raw / f"{name}_{k}_summary.json"
        s = json.loads(p.read_text()) if p.is_file() else {}
        results[k] = {"locust_exit_code": procs[k].returncode, "requests": s.get("requests"),
                      "failures": s.get("failures"), "output_tok_s": s.get("output_tok_s")}
    return rows, results


def plot(rows: list[dict], decisions: list[dict], t0_unix: float, title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    x = [r["minute"] for r in rows]
    for k, color in (("learning", "tab:blue"), ("static", "tab:orange")):
        ax1.plot(x, [r[k]["drafter_block_acceptance"] for r in rows], "-o", color=color, ms=3,
                 label=f"{k}: drafter acceptance at full block")
        ax1.plot(x, [r[k]["acceptance"] for r in rows], ":", color=color, label=f"{k}: served acceptance length")
        ax2.plot(x, [r[k]["tokens_per_s"] for r in rows], "-", color=color, label=k)
    for d in decisions:
        if "promote" not in d:
            continue
        m = (d["time"] - t0_unix) / 60
        for ax in (ax1, ax2):
            ax.axvline(m, color="green" if d["promote"] else "red", alpha=0.6, ls="--")
        ax1.annotate("promoted" if d["promote"] else "refused", (m, ax1.get_ylim()[1]), rotation=90, va="top",
                     fontsize=8, color="green" if d["promote"] else "red")
    ax1.set_ylabel("tokens per step")
    ax2.set_ylabel("output tokens/s")
    ax2.set_xlabel("minute")
    ax1.legend(fontsize=8, loc="lower right")
    ax2.legend(fontsize=8)
    ax1.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def main(argv: list[str] | None = None) -> int:
    import yaml

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("realcode", "prose"), default="realcode")
    p.add_argument("--config", default=str(REPO / "deploy/configs/cpu.yaml"))
    p.add_argument("--algorithm", choices=("dflash_adaptive", "dflash"), default="dflash_adaptive",
                   help="dflash: every step verifies the full block, so the served acceptance is the drafter's own "
                        "(under dflash_adaptive a low-acceptance workload runs width 1 and rarely tries the drafter)")
    p.add_argument("--temperature", type=float, default=None,
                   help="override the workload's (realcode 0, prose 1)")
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--window", type=float, default=60)
    p.add_argument("--users", type=int, default=3)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--learn-steps", type=int, default=40)
    p.add_argument("--min-sequences", type=int, default=96)
    p.add_argument("--final-seconds", type=float, default=120, help="the original-mix phase at the end")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    temperature = TEMPERATURE[a.workload] if a.temperature is None else a.temperature
    tag = a.workload if a.temperature is None else f"{a.workload}_t{a.temperature:g}"
    out = Path(a.out or REPO / f"benchmarks/results/learning_ab_{tag}_cpu.json")

    base = Path(a.config)
    cfg = yaml.safe_load(base.read_text())
    for section, key in (("model", "path"), ("speculative", "draft_model_path")):
        q = Path(cfg[section][key])
        cfg[section][key] = str(q if q.is_absolute() else (base.parent / q).resolve())
    cfg["speculative"]["algorithm"] = a.algorithm
    cfg["server"] |= {"admin_api_key_env": ADMIN_ENV, "cpu_threads": 1, "max_running_requests": 16}
    os.environ[ADMIN_ENV] = ADMIN
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        raw = tmp / "raw"
        raw.mkdir()
        for name, n, seed in ((a.workload, 20000 if a.workload == "realcode" else 3000, 5), ("original", 400, 6)):
            lines = dataset(name, n, seed)
            (tmp / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        learn_cfg = json.loads(json.dumps(cfg))
        learn_cfg["learning"] = {"enabled": True, "store_dir": str(tmp / "store"), "work_dir": str(tmp / "learner"),
                                 "steps": a.learn_steps, "min_sequences": a.min_sequences, "interval_seconds": 1,
                                 "metrics_port": None, "threads": 1}
        env = {ADMIN_ENV: ADMIN}
        with ManagedServer(learn_cfg, tmp, "learning", env=env) as learning, \
                ManagedServer(cfg, tmp, "static", env=env) as static:
            learn_cfg["server"]["port"] = int(learning.url.rsplit(":", 1)[1])
            (tmp / "learning.yaml").write_text(yaml.safe_dump(learn_cfg))
            servers = {"learning": learning, "static": static}
            log = open(tmp / "learner.log", "w")
            learner = subprocess.Popen([sys.executable, "-m", "service.cli", "learn", "loop", "-c",
                                        str(tmp / "learning.yaml")], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            t0_unix = time.time()

            def show(row: dict) -> None:
                print(f"[{row['minute']:5.1f} min] learning {row['learning']} | static {row['static']}", flush=True)

            try:
                rows, runs = run_phase(servers, tmp / f"{a.workload}.jsonl", a.users, 60 * a.minutes,
                                       temperature, a.max_new, a.window, raw, a.workload, show)
            finally:
                learner.terminate()
                learner.wait(60)
                log.close()
            final_rows, final_runs = run_phase(servers, tmp / "original.jsonl", a.users, a.final_seconds, 0.0,
                                               a.max_new, a.final_seconds + 60, raw, "original")
            final = final_rows[-1] if final_rows else {}
            print(f"[original mix] learning {final.get('learning')} | static {final.get('static')}", flush=True)
            decisions_path = tmp / "learner" / "decisions.jsonl"
            decisions = [json.loads(x) for x in decisions_path.read_text().splitlines()] if decisions_path.is_file() else []
            learner_tail = (tmp / "learner.log").read_text(errors="replace").splitlines()[-60:]
    for d in decisions:
        d.pop("figures", None)
        if "time" in d:
            d["minute"] = round((d["time"] - t0_unix) / 60, 1)

    lines = ["| minute | learning: drafter acceptance | learning: served acceptance | learning: tok/s | "
             "static: drafter acceptance | static: served acceptance | static: tok/s | swaps |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows + ([{**final, "minute": "original mix (after)"}] if final else []):
        L, S = r["learning"], r["static"]
        lines.append(f"| {r['minute']} | {L['drafter_block_acceptance']} | {L['acceptance']} | {L['tokens_per_s']} | "
                     f"{S['drafter_block_acceptance']} | {S['acceptance']} | {S['tokens_per_s']} | {L['swaps']} |")
    table = "\n".join(lines)
    print(table)
    for d in decisions:
        print(f"minute {d.get('minute')}: {'PROMOTED' if d.get('promote') else 'refused'} -- {d.get('reason')} "
              f"(start {d.get('start')}, captured {d.get('captured')})")
    summary = {"failed_requests": sum((r["failures"] or 0) for r in runs.values()) +
               sum((r["failures"] or 0) for r in final_runs.values()),
               "requests": {k: runs[k]["requests"] for k in runs}, "locust": runs, "locust_original": final_runs,
               "promotions": sum(1 for d in decisions if d.get("promote")),
               "refusals": sum(1 for d in decisions if "promote" in d and not d["promote"])}
    print(json.dumps(summary))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {**vars(a), "out": str(out.relative_to(REPO)) if out.is_relative_to(REPO)
                                        else str(out), "config": Path(a.config).name},
                               "windows": rows, "original_mix_after": final, "decisions": decisions,
                               "summary": summary, "table": table, "learner_log_tail": learner_tail}, indent=1) + "\n")
    plot(rows, decisions, t0_unix, f"learning vs static drafter ({a.algorithm}), {a.workload} "
         f"({'greedy' if not temperature else f'temperature {temperature:g}'}), {a.users} users each",
         out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
