"""What SGLang's router in front of a server costs a request: time to first token and end to end, direct vs routed.

One fleet of one replica (`dflash-serve fleet --replicas 1` of the config): the same server is asked directly on
its own port and through the router on the fleet's, one request at a time, streaming chat completions of the
bundled code prompts, by two clients: the `openai` SDK, and a plain keep-alive HTTP client (httpx, reading every
line of the stream, as Locust's requests session does), each path on its own connection pool. The paths alternate in
blocks of --block back-to-back requests, so both see the same server state and machine noise; back to back
matters: a connection idle between requests behaves differently (Linux acknowledges at once after idle, so a
missing TCP_NODELAY costs nothing there and 40 ms back to back). Prints a table and writes JSON.

    python benchmarks/router_overhead.py [--config deploy/configs/cpu.yaml] [--requests 60] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.server import ManagedFleet  # noqa: E402
from loadtest.dataset import load_prompts  # noqa: E402


def one_request_http(client, url: str, model: str, messages: list[dict], max_tokens: int) -> tuple[float, float]:
    """The same over a keep-alive connection that reads the whole stream (so the connection is reused)."""
    t0 = time.perf_counter()
    first = None
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if first is None and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - t0
    return (first if first is not None else float("nan")), time.perf_counter() - t0


def one_request(client, model: str, messages: list[dict], max_tokens: int) -> tuple[float, float]:
    """(time to first token, end to end) in seconds of one streaming chat completion."""
    t0 = time.perf_counter()
    first = None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True)
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    return (first if first is not None else float("nan")), time.perf_counter() - t0


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if x == x)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=REPO / "deploy/configs/cpu.yaml")
    p.add_argument("--requests", type=int, default=60, help="requests per path (direct, routed)")
    p.add_argument("--block", type=int, default=10, help="back-to-back requests per path before switching")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/router_overhead_cpu.json")
    a = p.parse_args(argv)
    import httpx
    from openai import OpenAI

    config = yaml.safe_load(a.config.read_text())
    for section, key in (("model", "path"), ("speculative", "draft_model_path")):
        if config.get(section, {}).get(key):
            config[section][key] = str((a.config.resolve().parent / config[section][key]).resolve())
    prompts = load_prompts(None)
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp, \
            ManagedFleet(config, Path(tmp), "fleet", replicas=1) as fleet:
        urls = {"direct": fleet.replica_urls[0], "routed": fleet.url}
        model = config["model"].get("served_name") or config["model"]["path"]
        calls = {}
        for path, u in urls.items():
            sdk = OpenAI(base_url=f"{u}/v1", api_key="unused", max_retries=0, timeout=300)
            raw = httpx.Client(timeout=300)
            calls[f"openai SDK, {path}"] = lambda m, sdk=sdk: one_request(sdk, model, m, a.max_tokens)
            calls[f"keep-alive HTTP, {path}"] = lambda m, raw=raw, u=u: one_request_http(raw, u, model, m,
                                                                                          a.max_tokens)
        paths = list(calls)
        for k in paths:  # warm every path (connections, the router's first routing)
            for i in range(3):
                calls[k](prompts[i % len(prompts)])
        samples: dict[str, dict[str, list[float]]] = {k: {"ttft": [], "e2e": []} for k in paths}
        for b, start in enumerate(range(0, a.requests, a.block)):
            # the same prompts on both paths, each path first in every other round: the prefix cache serves
            # the second path's copy of a prompt, so each path gets the cached copy half of the time
            order = paths if b % 2 == 0 else paths[::-1]
            for k in order:
                for i in range(start, min(start + a.block, a.requests)):
                    ttft, e2e = calls[k](prompts[i % len(prompts)])
                    samples[k]["ttft"].append(ttft)
                    samples[k]["e2e"].append(e2e)
            print(f"router_overhead: {min(start + a.block, a.requests)}/{a.requests} requests per path", flush=True)
    rows = {}
    for k, s in samples.items():
        rows[k] = {m: {"p50_ms": 1e3 * statistics.median(v), "p90_ms": 1e3 * quantile(v, 0.9),
                       "mean_ms": 1e3 * statistics.fmean(v)} for m, v in s.items()}
    over = {client: {m: {q: rows[f"{client}, routed"][m][q] - rows[f"{client}, direct"][m][q]
                         for q in ("p50_ms", "p90_ms", "mean_ms")} for m in ("ttft", "e2e")}
            for client in ("openai SDK", "keep-alive HTTP")}
    print(f"\n{a.requests} requests per path, 1 at a time, back to back in blocks of {a.block} on a keep-alive "
          f"connection, max_tokens {a.max_tokens}, config {a.config.name}\n")
    print("| client, path | TTFT p50 ms | TTFT p90 ms | e2e p50 ms | e2e p90 ms |")
    print("|---|---:|---:|---:|---:|")
    for client in ("openai SDK", "keep-alive HTTP"):
        for path in ("direct", "routed"):
            r = rows[f"{client}, {path}"]
            print(f"| {client}, {path} | {r['ttft']['p50_ms']:.1f} | {r['ttft']['p90_ms']:.1f} | "
                  f"{r['e2e']['p50_ms']:.1f} | {r['e2e']['p90_ms']:.1f} |")
        o = over[client]
        print(f"| {client}: router overhead | {o['ttft']['p50_ms']:+.1f} | {o['ttft']['p90_ms']:+.1f} | "
              f"{o['e2e']['p50_ms']:+.1f} | {o['e2e']['p90_ms']:+.1f} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"config": str(a.config), "requests": a.requests, "block": a.block,
                                 "max_tokens": a.max_tokens,
                                 "rows": rows, "overhead": over, "samples": samples}, indent=1) + "\n")
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
