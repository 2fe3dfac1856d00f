"""A drafter that learns the traffic it serves, against one real dflash_adaptive server with `learning:`
on and an admin key: capture (token ids kept, opt-out honoured, nothing in the log), a hot swap mid-stream (greedy
output identical to the server's own output before any swap, in-flight and after), rollback (`dflash-serve learn
rollback` puts back the exact weights: SGLang's draft checksum), the learner killed mid-round (serving and the
drafter untouched), and the learner killed mid-swap (generation paused, part of a drafter loaded): the server ends
the swap itself after its pause lease, with the drafter it had.

The swapped-in drafter is the bundled one with noise on every weight: it drafts differently (its checksum differs)
and worse, which is the hard case for the identity: more rejected drafts.
"""
from __future__ import annotations

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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from dflash_models.learn import store, swap
from dflash_models.learn.versions import Versions
from harness.server import http_json
from tests.conftest import REPO, default_config

pytestmark = pytest.mark.server

ADMIN, ADMIN_ENV = "admin-key-42-learning", "DFLASH_LEARN_TEST_ADMIN_KEY"
PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n"
LEASE = 8  # server.pause_lease_seconds: how long a killed learner's pause may last


@pytest.fixture(scope="module")
def learning(module_server_factory, tiny_pair, tmp_path_factory):
    work = tmp_path_factory.mktemp("learning")
    cfg = default_config(tiny_pair, algorithm="dflash_adaptive", draft_model_path=tiny_pair["drafter"])
    cfg["server"] |= {"admin_api_key_env": ADMIN_ENV, "pause_lease_seconds": LEASE}
    cfg["learning"] = {"enabled": True, "store_dir": str(work / "store"), "work_dir": str(work / "learner"),
                       "min_sequences": 8, "steps": 2, "metrics_port": None}
    os.environ[ADMIN_ENV] = ADMIN  # the learner's (the server gets it through its env below)
    server = module_server_factory(cfg, "learning", env={ADMIN_ENV: ADMIN})
    cfg["server"]["port"] = int(server.url.rsplit(":", 1)[1])
    config_path = work / "learning.yaml"
    config_path.write_text(yaml.safe_dump(cfg))
    return {"server": server, "work": work, "config": config_path, "cfg": cfg, "drafter": tiny_pair["drafter"]}


def _perturbed(src: Path, out: Path, scale: float = 0.5) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(42)
    sd = {k: (v.float() + scale * v.float().std() * torch.randn(v.shape, generator=g)).to(torch.bfloat16)
          for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((src / "config.json").read_text())
    return out


def _drafter_series(server) -> dict[str, float]:
    text = server.metrics()
    info = {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^dflash_drafter_info\{drafter_version="([^"]+)"[^}]*\} (\S+)', text, re.M)}
    swaps = re.search(r"^dflash_drafter_swaps_total\{[^}]*\} (\S+)", text, re.M)
    return {**info, "_swaps": float(swaps.group(1)) if swaps else float("nan")}


def _wait_for(pred, timeout: float = 10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    return pred()


def test_capture_keeps_token_ids_and_honours_the_opt_out(learning):
    server = learning["server"]
    kept = server.generate_text("class Cache:\n    def __init__(self):\n", max_new_tokens=24, temperature=0)
    optout = server.generate_text("import json\nimport os\n", max_new_tokens=24, temperature=0,
                                  custom_params={"dflash_capture": False})
    store_dir = Path(learning["cfg"]["learning"]["store_dir"])
    found = _wait_for(lambda: [c for c in store.read(store_dir) if c.output == kept["output_ids"]])
    assert found, "the finished request's output ids are not in the store"
    assert not [c for c in store.read(store_dir) if c.output == optout["output_ids"]], "an opted-out request was kept"
    assert oct(store_dir.stat().st_mode & 0o777) == "0o700"
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in store_dir.glob("seg-*.jsonl"))
    log = server.log_path.read_text(errors="replace")
    assert json.dumps(kept["output_ids"]) not in log and ",".join(map(str, kept["output_ids"][:8])) not in log


def _stream(server, out: dict) -> None:
    body = {"text": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(f"{server.url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                chunk = json.loads(line[5:])
                out["ids"] = chunk["output_ids"]
                out["chunks"] = out.get("chunks", 0) + 1


def test_a_swap_mid_stream_keeps_greedy_output_and_rollback_restores_the_drafter(learning, tmp_path):
    server = learning["server"]
    reference = server.generate_text(PROMPT, max_new_tokens=160, temperature=0)["output_ids"]
    before = swap.draft_checksum(server.url, ADMIN)
    assert _drafter_series(server)["initial"] == 1.0

    # the learner's state as a promotion leaves it, so that `learn rollback` has something to roll back to
    versions = Versions(learning["cfg"]["learning"]["work_dir"], learning["drafter"])
    candidate = _perturbed(learning["drafter"], versions.path("v0001"))
    out: dict = {}
    t = threading.Thread(target=_stream, args=(server, out))
    t.start()
    assert _wait_for(lambda: out.get("chunks", 0) >= 3, 120), "the stream never started"
    done = swap.push(server.url, candidate, "v0001", ADMIN)
    at_swap = len(out.get("ids", []))
    t.join(600)
    versions.promote("v0001")

    assert 0 < at_swap < len(reference), "the swap did not land mid-stream"
    assert out["ids"] == reference, "greedy output changed across a drafter swap"
    assert swap.draft_checksum(server.url, ADMIN) != before, "the draft weights did not change"
    assert server.generate_text(PROMPT, max_new_tokens=160, temperature=0)["output_ids"] == reference
    series = _drafter_series(server)
    assert series["v0001"] == 1.0 and series["initial"] == 0.0 and series["_swaps"] == 1.0
    assert done["version"] == "v0001"

    r = subprocess.run([sys.executable, "-m", "service.cli", "learn", "rollback", "-c", str(learning["config"])],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert swap.draft_checksum(server.url, ADMIN) == before, "rollback did not restore the previous weights"
    series = _drafter_series(server)
    assert series["initial"] == 1.0 and series["v0001"] == 0.0 and series["_swaps"] == 2.0
    assert versions.serving == "initial"
    assert server.generate_text(PROMPT, max_new_tokens=160, temperature=0)["output_ids"] == reference


def test_swap_routes_refuse_the_client_side(learning):
    """The swap is an admin route: without the admin key it is refused and nothing changes."""
    server = learning["server"]
    before = swap.draft_checksum(server.url, ADMIN)
    with pytest.raises(swap.SwapError, match="HTTP 40[13]"):
        swap.push(server.url, learning["drafter"], "rogue", None)
    assert swap.draft_checksum(server.url, ADMIN) == before
    assert "rogue" not in _drafter_series(server)


def test_the_learner_killed_mid_round_leaves_serving_untouched(learning):
    server = learning["server"]
    for i in range(8):  # enough captured traffic for a round
        server.generate_text(f"# note {i}\ndef f{i}(x):\n", max_new_tokens=24, temperature=0)
    settings = yaml.safe_load(learning["config"].read_text())["learning"]
    work = Path(settings["work_dir"])
    captured = store.read(settings["store_dir"])
    import torch  # a small original-mix cache: the round starts training without generating one

    (work / "original").mkdir(parents=True, exist_ok=True)
    orig = {"sequences": [c.sequence for c in captured[:8]], "starts": [len(c.prompt) for c in captured[:8]]}
    torch.save(orig, work / "original" / "train.pt")
    torch.save(orig, work / "original" / "eval.pt")
    state = Versions(work, learning["drafter"]).state()
    before = swap.draft_checksum(server.url, ADMIN)
    reference = server.generate_text(PROMPT, max_new_tokens=48, temperature=0)["output_ids"]
    swaps = _drafter_series(server)["_swaps"]

    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "learn", "round", "-c", str(learning["config"])],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen = []
    for line in proc.stdout:  # killed once it is training
        seen.append(line)
        if line.startswith("[learn] round on"):
            break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert any(x.startswith("[learn] round on") for x in seen), "".join(seen)

    assert server.generate_text(PROMPT, max_new_tokens=48, temperature=0)["output_ids"] == reference
    assert swap.draft_checksum(server.url, ADMIN) == before
    assert Versions(work, learning["drafter"]).state() == state
    assert _drafter_series(server)["_swaps"] == swaps


def test_sampled_output_keeps_plain_distribution_while_the_drafter_is_swapped(learning, plain_server, tokenizer,
                                                                               tmp_path):
    """Temperature 1 with the drafter swapped back and forth underneath (a noisy drafter and the bundled one,
    requests paused in place around each swap): the samples keep plain decoding's distribution --
    tests/integration/test_lossless.py's statistic, samples and ALPHA (false failures <= 2e-3 per run)."""
    from tests.conftest import PROMPTS
    from tests.integration.test_lossless import ALPHA, SAMPLES, _sample_tokens
    from tests.sampling_stats import marginal_pvalue

    server = learning["server"]
    ids = tokenizer(PROMPTS[2])["input_ids"]
    drafters = [_perturbed(learning["drafter"], tmp_path / "noisy"), learning["drafter"]]
    encoded = [swap.payloads(d) for d in drafters]
    stop, landed = threading.Event(), []

    def swapper() -> None:
        while not stop.is_set():
            i = len(landed)
            swap.push(server.url, drafters[i % 2], f"sampling-{i}", ADMIN, encoded=encoded[i % 2])
            landed.append(time.monotonic())

    thread = threading.Thread(target=swapper)
    start = time.monotonic()
    thread.start()
    try:
        spec, accept = _sample_tokens(server, ids, SAMPLES)
    finally:
        end = time.monotonic()
        stop.set()
        thread.join(120)
        swap.push(server.url, learning["drafter"], "initial", ADMIN)
    assert sum(start < t < end for t in landed) >= 2, "fewer than two swaps landed while sampling"
    assert sum(accept) / len(accept) > 1.02, "no draft accepted: verification was not exercised"
    base, _ = _sample_tokens(plain_server, ids, SAMPLES)
    for pos in (1, 2):
        p = marginal_pvalue([s[pos] for s in spec], [b[pos] for b in base])
        assert p > ALPHA, f"token {pos + 1} distribution differs from plain decoding's across swaps (p={p:.2e})"
    assert server.proc.poll() is None


def _faulty(src: Path, out: Path, fault: str) -> Path:
    """The bundled drafter with one fault: a NaN or an Inf in one weight, or one weight of the wrong shape."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = load_file(str(src / "model.safetensors"))
    name = sorted(k for k, v in sd.items() if v.dim() == 2)[-1]  # the last chunk's: earlier chunks load first
    if fault == "wrong_shape":
        sd[name] = torch.zeros(sd[name].shape[0] + 1, sd[name].shape[1], dtype=sd[name].dtype)
    else:
        sd[name] = sd[name].clone()
        sd[name].view(-1)[7] = float("nan") if fault == "nan" else float("inf")
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((src / "config.json").read_text())
    return out


@pytest.mark.parametrize("fault", ["nan", "inf", "wrong_shape"])
def test_a_faulty_drafter_is_refused_and_serving_goes_on_unchanged(learning, plain_server, tmp_path, fault):
    """A pushed drafter with a NaN, an Inf or a wrongly shaped weight: the server refuses the update (the push
    raises, naming it), keeps the drafter it had (checksum, version, swap count), keeps serving, and its greedy
    output stays plain decoding's. Chunks before the faulty one were already loaded: refused means rolled back."""
    server = learning["server"]
    before, swaps = swap.draft_checksum(server.url, ADMIN), _drafter_series(server)["_swaps"]
    candidate = _faulty(learning["drafter"], tmp_path / fault, fault)
    assert len(swap.payloads(candidate, chunk_bytes=64 * 1024)) > 1  # the fault is not in the first chunk
    with pytest.raises(swap.SwapError, match="update_weights_from_tensor"):
        swap.push(server.url, candidate, f"bad-{fault}", ADMIN, encoded=swap.payloads(candidate, chunk_bytes=64 * 1024))
    assert server.proc.poll() is None, server.log_tail()
    assert swap.draft_checksum(server.url, ADMIN) == before, "the faulty weights (or part of them) stayed loaded"
    assert _drafter_series(server)["_swaps"] == swaps
    want = plain_server.generate_text(PROMPT, max_new_tokens=48, temperature=0)["output_ids"]
    out = server.generate_text(PROMPT, max_new_tokens=48, temperature=0)
    assert out["output_ids"] == want
    assert out["meta_info"].get("weight_version") != f"bad-{fault}"


class _HoldingProxy:
    """Between the learner and the server: forwards its calls, but gates its /pause_generation on `go` (so that the
    test starts a stream first) and never forwards its second /update_weights_from_tensor: there the learner waits
    -- generation paused, the weight-update session open, the first chunk of its drafter loaded -- and `held` is
    set, the worst moment to kill it."""

    def __init__(self, target: str) -> None:
        self.pausing, self.go, self.held, self.done = (threading.Event() for _ in range(4))
        self.paths: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                proxy.paths.append(self.path)
                if self.path == "/pause_generation":
                    proxy.pausing.set()
                    proxy.go.wait(120)
                if proxy.paths.count("/update_weights_from_tensor") == 2 and self.path.endswith("_tensor"):
                    proxy.held.set()
                    proxy.done.wait(600)
                    return
                headers = {k: v for k in ("Content-Type", "Authorization") if (v := self.headers.get(k))}
                req = urllib.request.Request(target + self.path, data=body, method="POST", headers=headers)
                try:
                    with urllib.request.urlopen(req, timeout=300) as r:
                        status, data = r.status, r.read()
                except urllib.error.HTTPError as e:
                    status, data = e.code, e.read()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.go.set()
        self.done.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_learner_killed_mid_swap_leaves_the_server_serving_its_drafter(learning, plain_server, tmp_path):
    """The learner SIGKILLed in the middle of a hot swap -- after it paused generation (a stream running), opened
    the weight-update session and loaded the first chunk of its drafter, before it ended the session or resumed --
    never runs its `finally`. The server ends the swap itself after server.pause_lease_seconds: the chunk it loaded
    is rolled back (SGLang's draft checksum is the one before), the paused stream and a request sent while paused
    finish with plain decoding's greedy output, the drafter's version and swap count are unchanged, the learner's
    state too, and the next push is accepted (no session left open)."""
    server = learning["server"]
    want = plain_server.generate_text(PROMPT, max_new_tokens=160, temperature=0)["output_ids"]
    first = server.generate_text(PROMPT, max_new_tokens=160, temperature=0)
    assert first["output_ids"] == want
    before, series = swap.draft_checksum(server.url, ADMIN), _drafter_series(server)

    work = tmp_path / "learner"  # a learner whose `rollback` pushes a noisy drafter, through the proxy
    versions = Versions(work, learning["drafter"])
    _perturbed(learning["drafter"], versions.path("v0001"))
    versions.promote("v0001")
    versions.promote("v0002")
    state = versions.state()
    proxy = _HoldingProxy(server.url)
    cfg = json.loads(json.dumps(learning["cfg"]))
    cfg["learning"] |= {"work_dir": str(work), "servers": [proxy.url]}
    (tmp_path / "learner.yaml").write_text(yaml.safe_dump(cfg))
    log = tmp_path / "learner.log"
    out: dict = {}
    stream = threading.Thread(target=_stream, args=(server, out))
    learner = None
    try:
        with open(log, "w") as f:
            learner = subprocess.Popen([sys.executable, "-m", "service.cli", "learn", "rollback", "-c",
                                        str(tmp_path / "learner.yaml")], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        assert proxy.pausing.wait(180), log.read_text()
        stream.start()
        assert _wait_for(lambda: out.get("chunks", 0) >= 3, 120), "the stream never started"
        proxy.go.set()
        assert proxy.held.wait(120), log.read_text() + str(proxy.paths)
        assert swap.draft_checksum(server.url, ADMIN) != before, "no part of the learner's drafter was loaded"
        at_kill = len(out.get("ids", []))
        os.killpg(learner.pid, signal.SIGKILL)
        learner.wait(30)
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True}}
        during = http_json(f"{server.url}/generate", body, timeout=LEASE + 120)  # sent while paused: waits it out
        stream.join(LEASE + 120)
        assert not stream.is_alive(), "the stream the killed learner paused never resumed"
    finally:
        proxy.close()
        if learner is not None and learner.poll() is None:
            os.killpg(learner.pid, signal.SIGKILL)
    assert proxy.paths[:3] == ["/pause_generation", "/begin_weight_update", "/update_weights_from_tensor"]
    assert 0 < at_kill < len(want), "the learner's pause did not land mid-stream"
    assert out["ids"] == want, "greedy output of the paused stream changed"
    assert during["output_ids"] == want
    assert during["meta_info"].get("weight_version") == first["meta_info"].get("weight_version")
    assert swap.draft_checksum(server.url, ADMIN) == before, "part of the killed learner's drafter stayed loaded"
    assert _drafter_series(server) == series
    assert Versions(work, learning["drafter"]).state() == state
    assert "its client is gone" in server.log_path.read_text(errors="replace")
    swap.push(server.url, learning["drafter"], "initial", ADMIN)
    assert swap.draft_checksum(server.url, ADMIN) == before
    assert server.proc.poll() is None, server.log_tail()
