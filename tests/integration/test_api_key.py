"""With `server.api_key_env` set, generation needs the key, and the key leaks nowhere."""
from __future__ import annotations

import os
import subprocess
import urllib.error
import urllib.request

import pytest
from openai import AuthenticationError, OpenAI

from harness.server import ManagedServer
from tests.conftest import default_config

pytestmark = pytest.mark.server
KEY = "test-key-7f3a91c2"


@pytest.fixture(scope="module")
def keyed_server(tiny_pair, tmp_path_factory):
    cfg = default_config(tiny_pair, algorithm="none")
    cfg["server"]["api_key_env"] = "DFLASH_TEST_API_KEY"
    os.environ["DFLASH_TEST_API_KEY"] = KEY
    try:
        with ManagedServer(cfg, tmp_path_factory.mktemp("keyed"), "keyed") as server:
            yield server
    finally:
        os.environ.pop("DFLASH_TEST_API_KEY", None)


def test_requests_without_the_key_are_refused(keyed_server):
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{keyed_server.url}/v1", api_key="wrong", max_retries=0).completions.create(
            model="tiny", prompt="x", max_tokens=2)
    req = urllib.request.Request(f"{keyed_server.url}/v1/models")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401


def test_requests_with_the_key_are_served(keyed_server):
    r = OpenAI(base_url=f"{keyed_server.url}/v1", api_key=KEY, max_retries=0).completions.create(
        model="tiny", prompt="import os", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def test_the_key_is_not_in_logs_or_command_lines(keyed_server):
    assert KEY not in keyed_server.log_path.read_text(errors="replace")
    assert "'api_key': '***'" in keyed_server.log_path.read_text(errors="replace")  # the redacted line
    cmdlines = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert KEY not in cmdlines


def test_health_and_metrics_stay_open_for_probes_and_scrapers(keyed_server):
    """Documented policy (docs/SECURITY.md): liveness probes and Prometheus need no key."""
    for path in ("/health", "/metrics"):
        with urllib.request.urlopen(f"{keyed_server.url}{path}", timeout=30) as r:
            assert r.status == 200
