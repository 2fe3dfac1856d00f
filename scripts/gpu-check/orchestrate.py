"""Run the GPU check's serving checks on the GPU machine (run.sh calls it): one JSON report, the logs beside it.

    python3 scripts/gpu-check/orchestrate.py --out DIR [--work DIR] [--time-limit S] [--only NAME,...] [--serial]
                                             [--dry-run]

Every check (checks.py CHECKS) runs in its own process (`--one NAME`) with its own timeout (cut to what is left of
`--time-limit`, when one is given): a check that fails, raises or times out is recorded and the next one runs. The
tiny checks run side by side (`--serial`: one at a time), the rest one at a time. `--dry-run` runs this
orchestration with stand-in checks (no GPU, no server): the report's shape, a check that raises and one that
outlives its timeout -- what tests/unit/test_gpu_check.py runs. Exits 1 when a check failed, raised or timed out.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checks import CHECKS, Check, compare_greedy  # noqa: E402

SCHEMA = 2
STOP_S = 45  # a timed-out check's grace to stop its servers before it is killed
RESERVE_S = STOP_S + 15  # of a time limit, kept for the last check's stop and the report
RUN_VAR = "DFLASH_SERVE_GPU_CHECK_RUN"  # inherited by every process of a run: how its leftovers are found
BAD = ("fail", "error", "timeout")


# -- dry run: the orchestration without a GPU ------------------------------------------------------------------------

def _dry_pass(work: Path) -> dict:
    return {"status": "pass", "dry_run": True}


def _dry_raise(work: Path) -> dict:
    raise RuntimeError("dry-run: a check that raises is recorded as an error")


def _dry_hang(work: Path) -> dict:
    time.sleep(3600)
    return {"status": "pass"}


DRY_CHECKS = [Check(c.name, c.phase, c.timeout_s, _dry_pass) for c in CHECKS] + [
    Check("dry_error", "big", 30, _dry_raise),
    Check("dry_timeout", "big", 2, _dry_hang),
]


# -- orchestration ---------------------------------------------------------------------------------------------------

def run_one(check: Check, work: Path) -> None:
    """Child process: run one check, write results/<name>.json; SIGTERM unwinds (servers stopped on the way)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        detail = check.run(work)
        result = {"status": detail.pop("status", "pass"), "detail": detail}
    except BaseException as e:  # noqa: BLE001 -- every failure is the report's, none the run's
        result = {"status": "error", "error": "".join(traceback.format_exception(e))[-4000:]}
    result["seconds"] = round(time.monotonic() - t0, 1)
    (work / "results").mkdir(exist_ok=True)
    (work / "results" / f"{check.name}.json").write_text(json.dumps(result, indent=1, default=str))


def _spawn(check: Check, work: Path, dry: bool) -> subprocess.Popen:
    log = work / f"{check.name}.stdout"
    log.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, __file__, "--one", check.name, "--work", str(work)] + (["--dry-run"] if dry else [])
    return subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, check: Check, work: Path, timeout: float) -> dict:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return {"status": "timeout", "seconds": round(timeout, 1), "error": f"over its {timeout:.0f}s; stopped"}
    path = work / "results" / f"{check.name}.json"
    if not path.is_file():
        return {"status": "error", "error": f"the check's process exited {proc.returncode} without a result"}
    return json.loads(path.read_text())


def orchestrate(checks: list[Check], work: Path, limit_s: float | None, serial: bool, dry: bool) -> dict:
    started = time.monotonic()
    results: dict[str, dict] = {}

    def left() -> float:
        return float("inf") if limit_s is None else limit_s - RESERVE_S - (time.monotonic() - started)

    def skip(check: Check) -> bool:
        if left() < min(30.0, check.timeout_s):
            results[check.name] = {"status": "skipped", "error": f"{left():.0f}s of --time-limit left"}
            return True
        return False

    tiny = [c for c in checks if c.phase == "tiny"]
    if tiny and not serial:
        running = [(c, _spawn(c, work, dry)) for c in tiny if not skip(c)]
        for c, proc in running:
            results[c.name] = _finish(proc, c, work, max(1.0, min(c.timeout_s, left())))
    for c in checks:
        if c.name in results:
            continue
        if c.phase == "compare":
            results[c.name] = compare_greedy(results) if not dry else {"status": "pass", "dry_run": True}
        elif not skip(c):
            results[c.name] = _finish(_spawn(c, work, dry), c, work, max(1.0, min(c.timeout_s, left())))
    return results


def device_facts() -> dict:
    facts: dict[str, Any] = {"python": sys.version.split()[0]}
    for mod in ("torch", "triton", "transformers", "sglang"):
        try:
            from importlib import metadata

            facts[mod] = metadata.version(mod)
        except Exception as e:  # noqa: BLE001
            facts[mod] = f"absent ({type(e).__name__})"
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        facts["gpu"] = q.stdout.strip() or q.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        facts["gpu"] = f"no nvidia-smi ({type(e).__name__})"
    return facts


def _stop_leftovers(run_id: str) -> list[int]:
    """Processes of this run a timed-out check left behind (SGLang's run in their own sessions): found by the
    RUN_VAR they inherited, so nothing else on the machine is touched."""
    marker = f"{RUN_VAR}={run_id}".encode()
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        pid = int(environ.parent.name)
        try:
            if pid != os.getpid() and marker in environ.read_bytes().split(b"\0"):
                os.kill(pid, signal.SIGKILL)
                pids.append(pid)
        except (OSError, ProcessLookupError):
            continue
    return pids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="the report's folder: report.json")
    ap.add_argument("--work", type=Path, help="servers' configs and logs, the checks' results (default: OUT/work)")
    ap.add_argument("--time-limit", type=float, help="seconds for every check together (default: none; each "
                    "check has its own timeout)")
    ap.add_argument("--only", default="", help="comma-separated check names (default: all)")
    ap.add_argument("--serial", action="store_true", help="run the tiny checks one at a time")
    ap.add_argument("--dry-run", action="store_true", help="stand-in checks: no GPU, no server")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    table = DRY_CHECKS if a.dry_run else CHECKS
    if a.one:
        run_one(next(c for c in table if c.name == a.one), a.work)
        return 0
    if a.out is None:
        ap.error("--out is required")
    only = [n for n in a.only.split(",") if n]
    unknown = sorted(set(only) - {c.name for c in table})
    if unknown:
        ap.error(f"--only: unknown checks {unknown}; known: {[c.name for c in table]}")
    checks = [c for c in table if not only or c.name in only]
    a.work = a.work or a.out / "work"
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    run_id = os.environ.setdefault(RUN_VAR, uuid.uuid4().hex)
    t0 = time.time()
    results = orchestrate(checks, a.work, a.time_limit, a.serial, a.dry_run)
    leftovers = _stop_leftovers(run_id)
    counts: dict[str, int] = {}
    for r in results.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    report = {
        "schema": SCHEMA, "check": "dflash-serve scripts/gpu-check", "dry_run": a.dry_run,
        "started_unix": round(t0), "wall_s": round(time.time() - t0, 1), "time_limit_s": a.time_limit,
        "work": str(a.work),
        "device": {"dry_run": True} if a.dry_run else device_facts(),
        "checks": results, "summary": counts, "stopped_leftover_pids": leftovers,
    }
    (a.out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    width = max(len(n) for n in results)
    for name, r in results.items():
        print(f"{name:<{width}}  {r['status']:<8} {r.get('seconds', '')}")
    print(json.dumps(counts))
    return 1 if any(r["status"] in BAD for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
