"""Start-up, binding, a second server on a taken port, and SIGTERM under load, against the adaptive
configuration. One server: its /health is polled from the moment the process starts; the SIGTERM test ends it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from loadtest import faults
from harness.server import ManagedServer
from tests.conftest import default_config

pytestmark = pytest.mark.server
MODEL = "tiny"


def _get(url: str, timeout: float = 5) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


def _generate(url: str, max_tokens: int = 2) -> tuple[int | None, dict | None]:
    body = json.dumps({"model": MODEL, "prompt": "import os", "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None, None


@pytest.fixture(scope="module")
def started(tiny_pair, tmp_path_factory):
    """The server as users start it -- no `server.host` in the config -- with /health polled every 0.1 s from the
    moment the process exists; at its first 200 a generation is sent at once."""
    cfg = default_config(tiny_pair, algorithm="dflash_adaptive", draft_model_path=tiny_pair["drafter"])
    cfg["model"]["served_name"] = MODEL
    cfg["server"].pop("host", None)
    cfg["server"]["shutdown_grace_seconds"] = 120
    server = ManagedServer(cfg, tmp_path_factory.mktemp("lifecycle"), "lifecycle", host=None).spawn()
    polls: list[tuple[float, int | None]] = []
    first_generate = None
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < server.startup_timeout:
            assert server.proc.poll() is None, f"server exited:\n{server.log_tail()}"
            status = _get(f"{server.url}/health", timeout=5)
            polls.append((time.monotonic() - t0, status))
            if status == 200:
                first_generate = _generate(server.url)
                break
            time.sleep(0.1)
        yield {"server": server, "polls": polls, "first_generate": first_generate}
    finally:
        server.stop()


def test_health_is_not_200_before_a_generation_works(started):
    polls, (status, out) = started["polls"], started["first_generate"]
    assert polls and polls[-1][1] == 200, f"never healthy: {polls[-5:]}"
    assert status == 200 and out["usage"]["completion_tokens"] == 2, \
        "/health said 200 but the generation sent at that moment failed"
    before = {s for _, s in polls[:-1]}
    assert before <= {None, 503}, f"/health answered {before} before it was ready"


def test_binds_only_loopback_by_default(started):
    server = started["server"]
    pids = {server.proc.pid, *(p.pid for p in psutil.Process(server.proc.pid).children(recursive=True))}
    listening = [c for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == server.port]
    assert listening, "nothing listens on the server port"
    assert all(c.laddr.ip == "127.0.0.1" for c in listening), [c.laddr for c in listening]
    assert all(c.pid in pids for c in listening if c.pid)


def test_a_second_server_on_the_taken_port_fails_with_a_clear_message(started):
    server = started["server"]
    r = subprocess.run([sys.executable, "-m", "service.cli", "serve", "-c", str(server.config_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"server.port: 127.0.0.1:{server.port} is already in use" in r.stderr
    assert _generate(server.url)[0] == 200, "the first server was disturbed"


def test_sigterm_under_load_finishes_in_flight_requests_and_refuses_new_ones(started):
    """Eight streams decode 150 tokens each; SIGTERM arrives mid-way. Every stream completes all 150 tokens; a
    request sent during the drain gets a 503 with an OpenAI-style error, /health says 503; the launcher exits 0
    and no server process is left."""
    server = started["server"]
    sid = psutil.Process(server.proc.pid).children()[0].pid  # SGLang runs in its own session
    results: list[dict] = []
    streaming = threading.Semaphore(0)

    def stream():
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": 150,
                           "temperature": 0, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        req = urllib.request.Request(f"{server.url}/v1/chat/completions", body, {"Content-Type": "application/json"})
        usage, finish, told = None, None, False
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                for line in r:
                    if not told:
                        streaming.release()
                        told = True
                    if line.startswith(b"data: {"):
                        chunk = json.loads(line[6:])
                        usage = chunk.get("usage") or usage
                        for c in chunk.get("choices") or []:
                            finish = c.get("finish_reason") or finish
        except Exception as e:  # recorded, asserted below
            results.append({"error": repr(e)})
            return
        finally:
            if not told:
                streaming.release()
        results.append({"usage": usage, "finish": finish})

    threads = [threading.Thread(target=stream) for _ in range(8)]
    for t in threads:
        t.start()
    for _ in threads:
        assert streaming.acquire(timeout=120)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    status, body = faults.send(server.url, "POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "x", "max_tokens": 2}).encode(), {"Content-Type": "application/json"}, timeout=30)
    health = _get(f"{server.url}/health")
    for t in threads:
        t.join(300)
    assert len(results) == 8 and all("error" not in r for r in results), results
    assert all(r["finish"] == "length" and r["usage"]["completion_tokens"] == 150 for r in results), results
    assert status == 503, (status, body[:300])
    assert faults.error_shape_problem(503, body) is None
    assert health == 503
    assert server.proc.wait(180) == 0, server.log_tail()
    deadline = time.monotonic() + 15  # the launcher returns when SGLang's main process exits; its children follow
    while (left := _session(sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], f"server processes left behind: {left}"


def _session(sid: int) -> list[str]:
    out = []
    for p in psutil.process_iter(["pid", "name", "status"]):
        if _sid(p.info["pid"]) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(f"{p.info['pid']} {p.info['name']} {p.info['status']}")
    return out


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None
