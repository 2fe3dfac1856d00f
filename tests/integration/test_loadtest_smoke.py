"""The load test a user runs: `locust -f loadtest/chat.py` and `python -m loadtest.sweep` against a real server.

Locust runs as a subprocess (as users run it): importing it here would gevent-patch the test process.
"""
from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from harness.server import free_port

REPO = Path(__file__).resolve().parents[2]
CUSTOM_METRICS = ("ttft", "itl", "tpot", "e2e", "output_tokens")


def locust(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "locust", "-f", "loadtest/chat.py", "--headless", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def stats(prefix: Path) -> dict[tuple[str, str], dict]:
    with open(f"{prefix}_stats.csv") as f:
        return {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}


SMOKE_SECONDS = 15


@pytest.mark.server
def test_headless_run_reports_every_custom_metric(dflash_server, tmp_path):
    prefix = tmp_path / "run"
    r = locust("-u", "5", "-r", "5", "-t", f"{SMOKE_SECONDS}s", "--csv", str(prefix), "--host", dflash_server.url,
               "--max-tokens", "32", "--summary-file", str(tmp_path / "summary.json"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = stats(prefix)
    chat = rows[("POST", "/v1/chat/completions")]
    assert int(chat["Request Count"]) > 0 and int(chat["Failure Count"]) == 0
    assert int(rows[("", "Aggregated")]["Failure Count"]) == 0
    for name in CUSTOM_METRICS:
        row = rows[("METRIC", name)]
        assert int(row["Request Count"]) > 0 and float(row["Average Response Time"]) > 0, name
    assert float(rows[("METRIC", "output_tokens")]["Max Response Time"]) <= 32
    # the request's own response time is the whole answer, not just its headers
    e2e = rows[("METRIC", "e2e")]
    assert float(chat["Average Response Time"]) == pytest.approx(float(e2e["Average Response Time"]))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["model"] == "tiny" and summary["failures"] == 0 and summary["output_tok_s"] > 0
    # Locust rewrites _stats.csv every second, not at exit: the summary may hold the last second's completions too
    # (~1.5 s of the run's completion rate; with the retrained drafter 5 users finish ~13 requests a second)
    done = summary["metrics"]["ttft"]["count"]
    assert 0 <= done - int(chat["Request Count"]) <= math.ceil(1.5 * done / SMOKE_SECONDS) + 2


@pytest.mark.parametrize("threshold, code", [("0.01", 1), ("1", 0)])
def test_unreachable_server_counts_failures_and_fails_the_run(tmp_path, threshold, code):
    prefix = tmp_path / "run"
    r = locust("-u", "2", "-r", "2", "-t", "3s", "--csv", str(prefix), "--host", f"http://127.0.0.1:{free_port()}",
               "--max-failure-ratio", threshold)
    assert r.returncode == code, r.stderr[-3000:]
    total = stats(prefix)[("", "Aggregated")]
    assert int(total["Failure Count"]) > 0 and total["Failure Count"] == total["Request Count"]
    assert "exceeds --max-failure-ratio" in r.stderr if code else "within --max-failure-ratio" in r.stderr


def test_requests_limit_ends_the_run(tmp_path):
    # no -t: only --requests can end it (failed requests count, so no server is needed)
    r = locust("-u", "2", "-r", "2", "--requests", "3", "--model", "m", "--host", f"http://127.0.0.1:{free_port()}",
               "--summary-file", str(tmp_path / "s.json"), timeout=60)
    assert r.returncode == 1, r.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["requests"] == 3 and summary["failures"] == 3


@pytest.mark.parametrize("model", [(), ("--model", "m")])
def test_an_open_loop_against_a_dead_server_still_ends(tmp_path, model):
    """Every arrival is spent even when it fails (the model lookup or the request itself): the run ends after
    warm-up + --requests arrivals, each a failure."""
    r = locust("-u", "4", "-r", "4", "--rate", "5", "--requests", "3", "--warmup-requests", "1", *model,
               "--host", f"http://127.0.0.1:{free_port()}", "--summary-file", str(tmp_path / "s.json"), timeout=60)
    assert r.returncode == 1, r.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["failures"] == summary["requests"] == 4 and summary["completed"] == 0


def _prompt_tokens(server) -> float:
    return sum(float(line.rpartition(" ")[2]) for line in server.metrics().splitlines()
               if line.startswith("sglang:prompt_tokens_total"))


@pytest.mark.server
def test_prompt_order_sequence_sends_every_prompt_in_turn(dflash_server, tmp_path):
    """`--prompt-order sequence` (the sweep's): 3 prompts of different lengths, 6 requests from one user -> each
    prompt exactly twice, read from the server's own prompt-token counter. A random draw gives that total with
    probability ~0.12, so the assertion can fail."""
    import urllib.request

    prompts = ["hi", "def add(a, b):\n    return a + b\n" * 3, "Write a letter to a friend. " * 12]
    data = tmp_path / "three.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in prompts))
    once = 0
    for p in prompts:  # what each prompt costs the counter
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": p}], "max_tokens": 1}).encode()
        req = urllib.request.Request(f"{dflash_server.url}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            once += json.load(r)["usage"]["prompt_tokens"]
    before = _prompt_tokens(dflash_server)
    r = locust("-u", "1", "-r", "1", "--requests", "6", "--host", dflash_server.url, "--dataset", str(data),
               "--max-tokens", "1", "--prompt-order", "sequence", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _prompt_tokens(dflash_server) - before == 2 * once


@pytest.mark.parametrize("bad, why", [
    ('{"conversation": []}', "none of 'messages', 'conversations' or 'prompt'"),
    ('{"prompt": "def f():", "temperature": -1}', "'temperature' must be a number >= 0"),
])
def test_bad_dataset_line_is_a_clear_startup_error(tmp_path, bad, why):
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n' + bad + "\n")
    r = locust("-u", "1", "-t", "2s", "--host", "http://127.0.0.1:9", "--dataset", str(data))
    assert r.returncode == 2
    assert f"--dataset {data}:2: {why}" in r.stderr


def test_client_tokenizer_that_is_not_one_is_a_clear_startup_error(tmp_path):
    # a missing directory: refused before transformers is imported (tests/unit/test_loadtest_client_work.py has
    # the directory without a tokenizer)
    r = locust("-u", "1", "-t", "2s", "--host", "http://127.0.0.1:9", "--client-tokenizer", str(tmp_path / "nope"))
    assert r.returncode == 2
    assert f"--client-tokenizer {tmp_path / 'nope'}: not a directory" in r.stderr


REALCODE = REPO / "loadtest" / "prompts" / "realcode.jsonl"
COMPLETION_TOKENS = 16


@pytest.fixture(scope="module")
def completions_run(dflash_server, tmp_path_factory):
    """One Locust run of raw-code completion prompts with the CPU-heavy client: 2 users, 4 requests of exactly
    16 tokens (each of the 2 prompts twice), every request recorded; and the server's generated-token count over
    the run."""
    tmp = tmp_path_factory.mktemp("completions")
    data = tmp / "realcode2.jsonl"
    data.write_text("".join(REALCODE.read_text().splitlines(keepends=True)[:2]))
    before = _generated_tokens(dflash_server)
    # --model: no /v1/models lookup, so the summary's request count is the completions alone (Locust's own CSV
    # is rewritten every second, not at exit: a run this short may end before it holds every request)
    r = locust("-u", "2", "-r", "2", "--requests", "4", "--host", dflash_server.url, "--model", "tiny",
               "--dataset", str(data), "--prompt-order", "sequence", "--max-tokens", str(COMPLETION_TOKENS),
               "--ignore-eos",
               "--summary-file", str(tmp / "summary.json"), "--record-file", str(tmp / "records.jsonl"),
               "--client-tokenizer", "models/tiny-code/target", timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {"stderr": r.stderr, "summary": json.loads((tmp / "summary.json").read_text()),
            "records": [json.loads(x) for x in (tmp / "records.jsonl").read_text().splitlines()],
            "generated": _generated_tokens(dflash_server) - before}


def _generated_tokens(server) -> float:
    return sum(float(line.rpartition(" ")[2]) for line in server.metrics().splitlines()
               if line.startswith("sglang:generation_tokens_total"))


@pytest.mark.server
def test_completion_prompts_stream_from_v1_completions_timed_and_counted(completions_run):
    summary, records = completions_run["summary"], completions_run["records"]
    assert (summary["requests"], summary["failures"]) == (4, 0)
    # Locust's console table: the requests went to /v1/completions, none to the chat endpoint
    table = completions_run["stderr"]
    assert "POST     /v1/completions" in table and "chat/completions" not in table
    for name in CUSTOM_METRICS:
        assert summary["metrics"][name]["count"] > 0, name
    # counted from the stream's usage chunk, and the server generated exactly those tokens
    assert summary["output_tokens_total"] == 4 * COMPLETION_TOKENS == completions_run["generated"]
    assert summary["metrics"]["ttft"]["count"] == 4 and summary["output_tok_s"] > 0
    assert sorted(r["line"] for r in records) == [1, 1, 2, 2]
    assert all(r["endpoint"] == "/v1/completions" and r["text"] and r["ttft_ms"] < r["e2e_ms"] for r in records)


@pytest.mark.server
def test_cpu_heavy_client_retokenizes_the_whole_text_on_every_chunk(completions_run, tokenizer):
    summary, records = completions_run["summary"], completions_run["records"]
    chunks = sum(r["chunks"] for r in records)
    assert summary["metrics"]["client_tokenize"]["count"] == chunks       # once per streamed chunk
    assert "METRIC   client_tokenize" in completions_run["stderr"]           # a row of Locust's own table too
    for r in records:   # the last pass read the whole answer, not the last chunk
        assert r["client_tokens"] == len(tokenizer.encode(r["text"], add_special_tokens=False)) > 0
        assert r["client_tokenize_ms"] > 0


@pytest.mark.server
def test_a_line_temperature_reaches_the_server(dflash_server, tmp_path):
    """--temperature 1, one line overriding it with 0: that line's answers are the same every time (greedy), the
    other line's differ (sampled), read from the answers the server streamed."""
    prompt = "Write a short story about a lighthouse keeper."
    data = tmp_path / "two.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": prompt}], "temperature": 0}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": prompt}]}) + "\n")
    r = locust("-u", "1", "-r", "1", "--requests", "6", "--host", dflash_server.url, "--dataset", str(data),
               "--temperature", "1", "--max-tokens", "16", "--ignore-eos", "--prompt-order", "sequence",
               "--record-file", str(tmp_path / "records.jsonl"), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    texts = {line: [x["text"] for x in records if x["line"] == line] for line in (1, 2)}
    assert [len(texts[1]), len(texts[2])] == [3, 3]
    assert {x["temperature"] for x in records if x["line"] == 1} == {0.0}
    assert {x["temperature"] for x in records if x["line"] == 2} == {1.0}
    assert len(set(texts[1])) == 1, texts[1]          # greedy: the line's own temperature 0 won
    assert len(set(texts[2])) > 1, texts[2]           # sampled at --temperature 1


@pytest.mark.server
def test_small_sweep_against_a_running_server(dflash_server, tmp_path):
    """Both shipped workloads (code mix greedy, prose at temperature 1), each into its own directory."""
    top = tmp_path / "sweep"
    r = subprocess.run([sys.executable, "-m", "loadtest.sweep", "--url", f"tiny={dflash_server.url}",
                        "--workloads", "code", "prose",
                        "--users", "1", "2", "--duration", "5", "--max-tokens", "32", "--warmup", "1",
                        "--out", str(top)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[sweep] config 1/1 tiny, prose, users 2 (2/2)" in r.stdout
    prose = json.loads((top / "prose" / "results.json").read_text())
    assert prose["meta"]["temperature"] == 1 and prose["meta"]["dataset"].endswith("prose.jsonl")
    assert [(p["config"], p["users"], p["ok"]) for p in prose["points"]] == [("tiny", 1, True), ("tiny", 2, True)]
    out = top / "code"
    points = json.loads((out / "results.json").read_text())["points"]
    assert [(p["config"], p["users"], p["ok"]) for p in points] == [("tiny", 1, True), ("tiny", 2, True)]
    assert all(p["output_tok_s"] > 0 and p["failures"] == 0 for p in points)
    assert all(p["server"]["accept_length"] and p["server"]["accept_length"] >= 1 for p in points)  # DFlash server
    md = (out / "report.md").read_text()
    assert "| tiny | 1 |" in md and "| tiny | 2 |" in md
    for name in ("results.csv", "throughput.png", "ttft.png", "itl.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "raw" / "tiny" / "u2_stats.csv").is_file()


@pytest.mark.server
def test_interleaved_sweep_measures_each_point_for_every_configuration_in_turn(dflash_server, tmp_path):
    """--interleave: at each point every configuration runs before the next point starts, the order reversed on
    every other point, so a ratio between configurations is measured side by side."""
    r = subprocess.run([sys.executable, "-m", "loadtest.sweep", "--url", f"a={dflash_server.url}",
                        "--url", f"b={dflash_server.url}", "--interleave", "--workloads", "code",
                        "--users", "1", "2", "--duration", "3", "--max-tokens", "16", "--warmup", "0",
                        "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    points = json.loads((tmp_path / "code" / "results.json").read_text())["points"]
    assert [(p["config"], p["users"], p["ok"]) for p in points] == [
        ("a", 1, True), ("b", 1, True), ("b", 2, True), ("a", 2, True)]
    md = (tmp_path / "code" / "report.md").read_text()
    assert "| a | 2 |" in md and "Interleaved: every configuration's server up at once" in md


@pytest.mark.server
def test_sweep_runs_the_workloads_that_look_like_users(dflash_server, tmp_path):
    """realcode (completions), mixed (per-line temperatures) and code-heavy-client, one short point each: each
    measured, and each report says what its users sent and did."""
    r = subprocess.run([sys.executable, "-m", "loadtest.sweep", "--url", f"tiny={dflash_server.url}",
                        "--workloads", "realcode", "mixed", "code-heavy-client", "--users", "2", "--duration", "4",
                        "--max-tokens", "16", "--warmup", "1", "--out", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for wl in ("realcode", "mixed", "code-heavy-client"):
        points = json.loads((tmp_path / wl / "results.json").read_text())["points"]
        assert [(p["users"], p["ok"], p["failures"]) for p in points] == [(2, True, 0)], wl
    md = {wl: (tmp_path / wl / "report.md").read_text() for wl in ("realcode", "mixed", "code-heavy-client")}
    assert "streaming completions (raw prompts, no chat template)" in md["realcode"]
    assert "(the prompts' own: 0, 1)" in md["mixed"]
    heavy = json.loads((tmp_path / "code-heavy-client" / "results.json").read_text())["points"][0]
    assert heavy["client_tokenize"]["count"] > 0 and "## Client work" in md["code-heavy-client"]
    mixed = json.loads((tmp_path / "mixed" / "results.json").read_text())["points"][0]
    assert mixed["client_tokenize"]["count"] == 0 and "## Client work" not in md["mixed"]   # no client work asked


@pytest.mark.server
def test_open_loop_sends_on_schedule_and_measures_only_after_the_warmup(dflash_server, tmp_path):
    """--rate 4 --arrival constant: the 8 measured requests leave 0.25 s apart whatever the answers do, after 2
    warm-up arrivals that are sent (the server counts them) but not measured."""
    before = _requests_total(dflash_server)
    r = locust("-u", "8", "-r", "8", "--host", dflash_server.url, "--model", "tiny", "--rate", "4",
               "--arrival", "constant", "--requests", "8", "--warmup-requests", "2", "--max-tokens", "16",
               "--slo-ttft", "60000", "--summary-file", str(tmp_path / "s.json"),
               "--record-file", str(tmp_path / "r.jsonl"), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    records = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert summary["completed"] == len(records) == 8 and summary["rate"] == 4
    assert _requests_total(dflash_server) - before == 10
    sent = sorted(x["sent_s"] for x in records)
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, abs=0.05), gaps
    assert summary["dispatch_delay_ms"]["count"] == 8
    assert summary["goodput_req_s"] == pytest.approx(summary["req_s"]) and summary["slo_met"] == 8


def _requests_total(server) -> float:
    return sum(float(line.rpartition(" ")[2]) for line in server.metrics().splitlines()
               if line.startswith("sglang:num_requests_total"))


@pytest.mark.server
def test_sweep_at_request_rates_reports_goodput_and_the_pareto_curve(dflash_server, tmp_path):
    r = subprocess.run([sys.executable, "-m", "loadtest.sweep", "--url", f"tiny={dflash_server.url}",
                        "--workloads", "code", "--rates", "1", "2", "--duration", "4", "--warmup-s", "1",
                        "--max-in-flight", "8", "--max-tokens", "16", "--warmup", "1", "--slo-ttft", "60000",
                        "--slo-tpot", "1", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[sweep] config 1/1 tiny, code, rate 2 req/s (2/2)" in r.stdout
    out = tmp_path / "code"
    points = json.loads((out / "results.json").read_text())["points"]
    assert [(p["rate"], p["users"], p["ok"], p["completed"]) for p in points] == [(1, None, True, 4),
                                                                                 (2, None, True, 8)]
    for p in points:
        # TPOT <= 1 ms: no request of a CPU server meets it, so goodput is 0 while throughput is not
        assert p["goodput_req_s"] == 0 and p["req_s"] > 0 and p["user_tok_s"] > 0
        assert p["server"]["accept_length"] >= 1
    md = (out / "report.md").read_text()
    assert "DFlash serving sweep at request rates" in md and "TPOT ≤ 1 ms" in md and "| tiny | 2 |" in md
    for name in ("pareto.png", "goodput.png", "throughput.png"):
        assert (out / name).stat().st_size > 0, name
