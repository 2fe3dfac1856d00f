"""`dflash-serve fleet` on loopback: two replicas of the embedded default (one CPU core each) behind SGLang's own
router (sglang-router), driven by Locust as users drive it.

What a user relies on: the API key guards the fleet (the replicas and the router, which registers the replicas
with it); traffic through the router succeeds and reaches both replicas; a replica that crashes
costs only the requests it was running (the router routes around it, the fleet restarts it, and it serves again);
SIGTERM lets every in-flight request finish and stops every process; a fleet whose replica cannot start exits
non-zero. Per-replica metrics in Prometheus: tests/deploy/test_live_stack.py (the compose fleet).
"""
from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from harness.server import ManagedFleet, free_port

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
USERS = 8
KEY_ENV, KEY = "DFLASH_FLEET_TEST_KEY", "sk-fleet-test-9f3b"
ADMIN_ENV, ADMIN = "DFLASH_FLEET_TEST_ADMIN_KEY", "sk-fleet-admin-20c7"


def default_config() -> dict:
    path = REPO / "deploy/configs/cpu.yaml"
    config = yaml.safe_load(path.read_text())
    for section, key in (("model", "path"), ("speculative", "draft_model_path")):
        config[section][key] = str((path.parent / config[section][key]).resolve())
    return config


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    config = default_config()
    config["server"] |= {"api_key_env": KEY_ENV, "admin_api_key_env": ADMIN_ENV}
    work = tmp_path_factory.mktemp("fleet")
    # learning on (capture to a store) so `dflash-serve learn --fleet` can swap the replicas' drafter
    config["learning"] = {"enabled": True, "store_dir": str(work / "store"), "work_dir": str(work / "learner"),
                          "metrics_port": None}
    f = ManagedFleet(config, work, "fleet", replicas=2, env={KEY_ENV: KEY, ADMIN_ENV: ADMIN})
    f.start()
    yield f
    f.stop()


def replica_requests(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(m) for m in re.findall(r"^sglang:num_requests_total\{[^}]*\} (\S+)$", text, re.M))


def locust(host: str, seconds: int, prefix: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", "loadtest/chat.py", "--headless", "-u", str(USERS), "-r", str(USERS),
         "-t", f"{seconds}s", "--csv", str(prefix), "--host", host, "--max-tokens", "32", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "LOCUST_API_KEY": KEY})


def chat_totals(prefix: Path) -> tuple[int, int]:
    with open(f"{prefix}_stats.csv") as f:
        row = next(r for r in csv.DictReader(f) if r["Name"] == "/v1/chat/completions")
    return int(row["Request Count"]), int(row["Failure Count"])


def server_pid(fleet: ManagedFleet, index: int) -> int:
    """The SGLang server process of replica `index` (its launcher's child)."""
    launcher = next(p for p in psutil.Process(fleet.proc.pid).children()
                    if any(a.endswith(f"replica-{index}.yaml") for a in p.cmdline()))
    return launcher.children()[0].pid


def status(url: str, key: str | None, body: dict | None = None) -> int:
    """The HTTP status of one request (0: nothing listens)."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError):
        return 0


def test_the_api_key_guards_the_router_and_every_replica(fleet):
    body = {"model": "dflash-tiny", "prompt": "def f(x):", "max_tokens": 2}
    for base in (fleet.url, *fleet.replica_urls):
        assert status(f"{base}/v1/completions", None, body) == 401, base
        assert status(f"{base}/v1/completions", "sk-wrong", body) == 401, base
        assert status(f"{base}/v1/completions", KEY, body) == 200, base
    # The router checks the key itself: nobody without it can register a replica of their own. (It answers
    # /v1/models and /get_server_info -- model names, worker counts -- without one.)
    assert status(f"{fleet.url}/workers", None) == 401
    assert status(f"{fleet.replica_urls[0]}/metrics", None) == 200  # Prometheus scrapes without the key
    cmdlines = " ".join(" ".join(p.cmdline()) for p in psutil.Process(fleet.proc.pid).children(True))
    assert KEY not in cmdlines and ADMIN not in cmdlines


def test_the_client_key_reaches_no_admin_route_through_the_router(fleet):
    """The router's control plane (/workers: which URLs it sends traffic to; /flush_cache) answers the admin key
    only, and the replicas' admin routes refuse the client key through the router as they do directly."""
    assert status(f"{fleet.url}/workers", KEY) == 401
    assert status(f"{fleet.url}/workers", ADMIN) == 200
    assert status(f"{fleet.url}/flush_cache", KEY, {}) == 401
    routes = (("/configure_logging", {"log_requests": True}), ("/flush_cache", {}), ("/pause_generation", {}))
    got = {(base, path): status(f"{base}{path}", KEY, body) for base in (fleet.url, *fleet.replica_urls)
           for path, body in routes}
    # each refusal exactly: a replica's admin route answers the client key 403 (authenticated, not an admin); the
    # router its own control plane 401 and the rest 404 (it forwards no admin route). A 500 is no refusal.
    want = {(fleet.url, "/configure_logging"): 404, (fleet.url, "/flush_cache"): 401,
            (fleet.url, "/pause_generation"): 404}
    want |= {(base, path): 403 for base in fleet.replica_urls for path, _ in routes}
    assert got == want


def test_locust_through_the_router_reaches_both_replicas(fleet, tmp_path):
    before = [replica_requests(u) for u in fleet.replica_urls]
    run = locust(fleet.url, 20, tmp_path / "run")
    out, _ = run.communicate(timeout=180)
    assert run.returncode == 0, out[-3000:]
    requests, failures = chat_totals(tmp_path / "run")
    assert requests > 0 and failures == 0, out[-3000:]
    served = [replica_requests(u) - b for u, b in zip(fleet.replica_urls, before)]
    assert all(n > 0 for n in served), f"requests per replica: {served}"


def test_the_sweep_behind_the_router_reads_every_replicas_metrics(fleet, tmp_path):
    """`loadtest.sweep --url` at the router, open loop: the router's own /metrics know no acceptance, so the sweep
    finds the replicas through the router's /workers (admin key in LOCUST_ADMIN_KEY) and sums their counters,
    before and after the point."""
    r = subprocess.run([sys.executable, "-m", "loadtest.sweep", "--url", f"fleet={fleet.url}", "--workloads", "code",
                        "--rates", "3", "--duration", "4", "--warmup-s", "1", "--max-tokens", "16", "--warmup", "1",
                        "--slo-ttft", "60000", "--slo-tpot", "60000", "--out", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "LOCUST_API_KEY": KEY, "LOCUST_ADMIN_KEY": ADMIN})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "is a router; reading the /metrics of its replicas" in r.stdout
    (point,) = json.loads((tmp_path / "code" / "results.json").read_text())["points"]
    assert sorted(point["metrics_from"]) == sorted(fleet.replica_urls)
    server = point["server"]
    assert server["metrics"] and server["accept_length"] >= 1 and server["generation_tokens"] > 0
    assert server["block_size_shares"] and server["position_acceptance"]
    assert 0 <= server["position_acceptance"]["1"] <= 1
    assert point["ok"] and point["completed"] == 12 and point["goodput_req_s"] == pytest.approx(point["req_s"])
    md = (tmp_path / "code" / "report.md").read_text()
    assert "## Acceptance by draft position" in md and "## Block sizes" in md


def _completion(fleet: ManagedFleet, prompt: str) -> str:
    body = json.dumps({"model": "dflash-tiny", "prompt": prompt, "max_tokens": 48, "temperature": 0}).encode()
    req = urllib.request.Request(f"{fleet.url}/v1/completions", body,
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]["text"]


def test_the_learner_swaps_and_rolls_back_every_replica_of_the_fleet(fleet, monkeypatch):
    """`dflash-serve learn --fleet` reaches each replica (the router is not one): a promoted drafter pushed to the
    fleet serves on both replicas (their draft checksums and `dflash_drafter_info`), greedy output through the
    router is unchanged, and `dflash-serve learn rollback --fleet` restores both replicas' exact weights."""
    from dflash_models.learn import swap
    from dflash_models.learn.versions import Versions
    from service import learn
    from service.config import load_config
    from tests.integration.test_learning import _perturbed

    monkeypatch.setenv(KEY_ENV, KEY)  # as the operator's shell has them: the config names both
    monkeypatch.setenv(ADMIN_ENV, ADMIN)
    config = load_config(fleet.config_path)
    urls = learn.servers(config, fleet=True)
    assert urls == fleet.replica_urls
    prompts = [f"def handler_{i}(request):\n    " for i in range(4)]
    reference = [_completion(fleet, p) for p in prompts]
    before = [swap.draft_checksum(u, ADMIN) for u in urls]
    settings = learn.settings(config, fleet=True)
    versions = Versions(settings["work_dir"], settings["initial_drafter"])
    candidate = _perturbed(Path(settings["initial_drafter"]), versions.path("v0001"))
    swap.push_all(urls, candidate, "v0001", ADMIN)
    versions.promote("v0001")

    after = [swap.draft_checksum(u, ADMIN) for u in urls]
    assert all(a != b for a, b in zip(after, before)), "a replica kept its old draft weights"
    for u in urls:
        with urllib.request.urlopen(f"{u}/metrics", timeout=10) as r:
            assert re.search(r'^dflash_drafter_info\{drafter_version="v0001"[^}]*\} 1', r.read().decode(), re.M), u
    assert [_completion(fleet, p) for p in prompts] == reference

    r = subprocess.run([sys.executable, "-m", "service.cli", "learn", "rollback", "-c", str(fleet.config_path),
                        "--fleet"], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ))
    assert r.returncode == 0, r.stdout + r.stderr
    assert [swap.draft_checksum(u, ADMIN) for u in urls] == before, "rollback did not restore every replica"
    assert [_completion(fleet, p) for p in prompts] == reference
    assert fleet.workers() == {u: True for u in urls}


def test_a_killed_replica_costs_only_its_in_flight_requests_and_rejoins(fleet, tmp_path):
    run = locust(fleet.url, 30, tmp_path / "kill")
    time.sleep(8)
    victim = server_pid(fleet, 0)
    os.killpg(victim, signal.SIGKILL)  # a crash: the server, its scheduler and detokenizer, no drain
    out, _ = run.communicate(timeout=240)
    requests, failures = chat_totals(tmp_path / "kill")
    # At most the requests replica-0 was running when it died (each of the USERS users runs one at a time);
    # the ones sent afterwards go to replica-1 (the router's retries and circuit breaker).
    assert requests > 2 * USERS and failures <= USERS, (requests, failures, out[-3000:])
    # The fleet restarts it, the router's health checks put it back in rotation, and it serves again. (The
    # router's view lags: it may still list the dead replica healthy until its checks fail, so wait for the
    # restarted server itself first.)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and status(f"{fleet.replica_urls[0]}/health", None) != 200:
        time.sleep(2)
    while time.monotonic() < deadline and not fleet.workers().get(fleet.replica_urls[0]):
        time.sleep(2)
    assert fleet.workers() == {u: True for u in fleet.replica_urls}, fleet.fleet_lines()
    assert any("replica-0 exited" in line for line in fleet.fleet_lines())
    assert any("replica-0 restarted" in line for line in fleet.fleet_lines())
    assert server_pid(fleet, 0) != victim
    again = locust(fleet.url, 10, tmp_path / "again")
    out, _ = again.communicate(timeout=180)
    assert chat_totals(tmp_path / "again")[1] == 0, out[-3000:]
    # Prompts the fleet has seen stay with the replica whose cache holds them (cache-aware routing); new ones go
    # to the replica with the least cached, which is the restarted one.
    body = {"model": "dflash-tiny", "max_tokens": 4}
    for i in range(6):
        prompt = f"# task {i}: {os.urandom(8).hex()}\nclass Parser{i}:"
        assert status(f"{fleet.url}/v1/completions", KEY, body | {"prompt": prompt}) == 200
    assert replica_requests(fleet.replica_urls[0]) > 0, "the restarted replica got no request"


def test_a_short_fault_soak_through_the_router_loses_nothing(fleet):
    """loadtest/fleet_soak.py's load on this fleet, short: a few users streaming and vanishing mid-stream while
    replica 1 is killed and restarted, and sending malformed bodies. Only the requests in flight on the killed
    replica may fail; nothing is left unanswered."""
    import asyncio

    from loadtest import fleet_soak

    args = fleet_soak.parse_args(["--users", "4", "--duration", "40", "--kill-at", "0.3", "--first-replica", "1",
                                  "--drain-timeout", "120", "--restart-timeout", "240",
                                  "--settle", "0"])
    report = asyncio.run(fleet_soak.run_against(args, fleet))
    detail = json.dumps({k: report[k] for k in ("outcomes", "kills", "failure_samples")}, default=str)[:3000]
    assert report["unexpected"] == 0 and report["lost"] == 0, detail
    assert report["requests"]["normal"] > 0 and report["outcomes"].get("disconnect:ok", 0) > 0, detail
    assert report["kills"][0]["router_again"] is not None, detail


def test_clients_bad_requests_never_take_a_replica_out_for_everyone(fleet):
    """A replica's 400 to one client's bad request says nothing about the replica: a burst of them (more than the
    router's circuit-breaker threshold per replica) leaves every replica serving the next client."""
    good = {"model": "dflash-tiny", "max_tokens": 4}
    for i in range(30):  # distinct prompts: cache-aware routing spreads them over both replicas
        bad = good | {"prompt": f"# bad {i}: {os.urandom(4).hex()}\ndef f():", "max_tokens": 10 ** 6}
        assert status(f"{fleet.url}/v1/completions", KEY, bad) == 400
    answers = [status(f"{fleet.url}/v1/completions", KEY, good | {"prompt": f"# good {i}\ndef g(x):"})
               for i in range(6)]
    assert answers == [200] * 6, answers
    assert fleet.workers() == {u: True for u in fleet.replica_urls}


def _stream(url: str, model: str, out: list, errors: list, started: threading.Event) -> None:
    from openai import OpenAI

    try:
        client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)
        stream = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        text, finish = "", None
        for chunk in stream:
            started.set()
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        out.append(finish)
    except Exception as e:  # noqa: BLE001 -- the assertion reports it
        errors.append(repr(e))


def test_sigterm_drains_every_replica_and_stops_every_process(fleet):
    """Last in the module: it stops the fleet."""
    children = psutil.Process(fleet.proc.pid).children(recursive=True)
    out: list = []
    errors: list = []
    started = threading.Event()
    threads = [threading.Thread(target=_stream, args=(fleet.url, "dflash-tiny", out, errors, started))
               for _ in range(4)]
    for t in threads:
        t.start()
    assert started.wait(60), errors
    time.sleep(0.5)
    fleet.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    assert not errors and out == ["length"] * 4, (out, errors)
    assert fleet.proc.wait(120) == 0, fleet.log_tail()
    assert any("got SIGTERM: draining" in line for line in fleet.fleet_lines())
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.info if hasattr(p, "info") else p.pid for p in alive]
    assert yaml.safe_load(fleet.targets_file.read_text()) == []  # a stopped fleet is not a fleet that is down


def test_a_replica_that_cannot_start_fails_the_fleet(tmp_path):
    config = default_config()
    config["fleet"] = {"startup_timeout_seconds": 3}
    config["server"]["shutdown_grace_seconds"] = 5  # a replica stopped mid-start may not drain: kill it soon
    f = ManagedFleet(config, tmp_path, "slow", replicas=2)
    f.proc = subprocess.Popen(f.argv, stdout=f.log_path.open("w"), stderr=subprocess.STDOUT)
    assert f.proc.wait(120) == 1, f.log_tail()
    assert any("not healthy after 3s (fleet.startup_timeout_seconds)" in line for line in f.fleet_lines())
    children_ports = [f.port, *f.replica_ports]
    for port in children_ports:  # nothing is left listening
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)


def test_a_busy_port_is_a_config_error(tmp_path):
    import socket

    config = default_config()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        config["server"]["port"] = busy
        config["fleet"] = {"replica_base_port": free_port() + 100}
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(config))
        r = subprocess.run([sys.executable, "-m", "service.cli", "fleet", "-c", str(path), "-n", "1"], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"server.port: 127.0.0.1:{busy} is already in use" in r.stderr, r.stderr
