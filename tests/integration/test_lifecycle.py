"""SIGTERM to `dflash-serve serve` drains: the in-flight request completes, then everything exits."""
from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.request

import pytest

from harness.server import ManagedServer
from tests.conftest import default_config

pytestmark = pytest.mark.server


def _pids_of_session(sid: int) -> list[int]:
    """Live processes of session `sid`. A zombie is dead and holds nothing but its PID until init reaps it (here
    SGLang's multiprocessing resource tracker, orphaned by the launcher's group kill: seen for ~1.5 s)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid=,stat="], capture_output=True, text=True).stdout.split()
    return [int(p) for p, s, st in zip(out[::3], out[1::3], out[2::3]) if int(s) == sid and not st.startswith("Z")]


def test_sigterm_lets_in_flight_request_finish_then_exits(tiny_pair, tmp_path):
    server = ManagedServer(default_config(tiny_pair), tmp_path, "lifecycle").start()
    sglang_sid = None
    try:
        children = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
        sglang_sid = int(subprocess.run(["ps", "-o", "sid=", "-p", children[0]], capture_output=True, text=True).stdout)
        result: dict = {}

        def long_request():
            body = json.dumps({"model": "tiny", "prompt": "import os", "max_tokens": 400, "temperature": 0,
                               "ignore_eos": True}).encode()
            req = urllib.request.Request(f"{server.url}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                result.update(json.load(r))

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(2.0)  # the request is decoding
        server.proc.send_signal(signal.SIGTERM)
        t.join(300)
        assert result.get("usage", {}).get("completion_tokens") == 400, "in-flight request was cut off"
        assert server.proc.wait(120) == 0
        time.sleep(1)
        assert _pids_of_session(sglang_sid) == [], "server processes left behind"
    finally:
        server.stop()
