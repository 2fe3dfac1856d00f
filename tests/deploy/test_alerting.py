"""Alerts reach someone: a shipped rule fires in a real Prometheus, which sends it to a real Alertmanager
configured as compose renders it from the operator's environment, which posts it to a webhook -- here a local
HTTP server. Debian: apt-get install prometheus prometheus-alertmanager."""
from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from deploy import promstack
from harness.server import free_port
from tests.deploy.conftest import alertmanager_config

FIRED = "DFlashServerDown"   # up{job="dflash-serve"} == 0: a replica nobody listens on is down for real


class Webhook:
    """A local receiver: every POST body it gets, parsed."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        received = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 -- http.server's name
                received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *_a) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _binary(*names: str) -> str:
    for n in names:
        if shutil.which(n):
            return shutil.which(n)
    pytest.skip(f"{' / '.join(names)} not found (Debian: apt-get install prometheus prometheus-alertmanager)")


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen | None) -> None:
    if proc and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(180)
def test_a_firing_rule_reaches_the_operators_webhook(tmp_path):
    prometheus = _binary("prometheus")
    alertmanager = _binary("alertmanager", "prometheus-alertmanager")
    hook = Webhook()
    procs: list[subprocess.Popen] = []
    try:
        # Alertmanager: the config compose renders, its receiver pointed at the local webhook; waits shortened
        am_cfg = alertmanager_config(hook.url)
        am_cfg["route"] |= {"group_wait": "1s", "group_interval": "1s"}
        (tmp_path / "alertmanager.yml").write_text(yaml.safe_dump(am_cfg))
        am_port = free_port()
        am_log = tmp_path / "alertmanager.log"
        procs.append(subprocess.Popen(
            [alertmanager, f"--config.file={tmp_path / 'alertmanager.yml'}", f"--storage.path={tmp_path / 'am'}",
             f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
            stdout=am_log.open("w"), stderr=subprocess.STDOUT))
        _wait(f"http://127.0.0.1:{am_port}/-/ready", procs[-1], am_log)

        # Prometheus: the shipped config and rules, scraping a replica port nobody listens on; the rule's
        # `for:` cut to 0s (the one change: a test cannot wait its two minutes), alerts to the local Alertmanager
        rules = tmp_path / "rules"
        rules.mkdir()
        for f in promstack.RULES_DIR.glob("*.yml"):
            doc = yaml.safe_load(f.read_text())
            for g in doc["groups"]:
                for r in g["rules"]:
                    if r.get("alert") == FIRED:
                        r["for"] = "0s"
            (rules / f.name).write_text(yaml.safe_dump(doc, sort_keys=False))
        shipped = yaml.safe_load(promstack.PROMETHEUS_YML.read_text())
        cfg = promstack.stack_config([f"127.0.0.1:{free_port()}"], "1s", rules_dir=rules)
        cfg["alerting"] = shipped["alerting"]
        cfg["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{am_port}"]}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        prom_port = free_port()
        prom_log = tmp_path / "prometheus.log"
        procs.append(subprocess.Popen(
            [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=prom_log.open("w"), stderr=subprocess.STDOUT))
        _wait(f"http://127.0.0.1:{prom_port}/-/ready", procs[-1], prom_log)

        deadline = time.monotonic() + 90
        fired = []
        while time.monotonic() < deadline and not fired:
            fired = [(b, a) for b in hook.bodies for a in b["alerts"] if a["labels"].get("alertname") == FIRED]
            time.sleep(0.5)
        assert fired, (f"no {FIRED} notification at the webhook; got {hook.bodies}\nprometheus:\n"
                       f"{prom_log.read_text()[-2000:]}\nalertmanager:\n{am_log.read_text()[-2000:]}")
        body, alert = fired[0]
        assert body["receiver"] == am_cfg["route"]["receiver"] and body["status"] == "firing"
        assert alert["status"] == "firing" and alert["labels"]["severity"] == "critical"
        assert alert["labels"]["job"] == "dflash-serve" and alert["annotations"]["summary"]
    finally:
        for p in reversed(procs):
            _stop(p)
        hook.close()
