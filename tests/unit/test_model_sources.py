"""Models by folder or by Hugging Face id, and downloads that verify (service/models.py, deploy/fetch_models.py),
against a hub served from this machine (tests/fake_hub.py): huggingface_hub itself does every download, in its own
process, pointed at the local hub by HF_ENDPOINT."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service.config import ConfigError, parse_config
from service.models import HubModel, parse_ref
from tests.fake_hub import FakeHub

REPO = Path(__file__).resolve().parents[2]
PAIR = REPO / "models" / "tiny-code"


def test_a_model_field_is_a_folder_or_a_hub_id(tmp_path):
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert parse_ref("Qwen/Qwen3-8B", tmp_path) == HubModel("Qwen/Qwen3-8B")
    assert parse_ref("z-lab/Qwen3-8B-DFlash-b16@v1.0", tmp_path) == HubModel("z-lab/Qwen3-8B-DFlash-b16", "v1.0")
    assert parse_ref("org/local", tmp_path) == tmp_path / "org" / "local"  # a folder of that name exists
    assert parse_ref("./Qwen/Qwen3-8B", tmp_path) == tmp_path / "Qwen" / "Qwen3-8B"  # ./ : always a folder
    assert parse_ref("/models/Qwen/Qwen3-8B", tmp_path) == Path("/models/Qwen/Qwen3-8B")
    assert parse_ref("target", tmp_path) == tmp_path / "target"
    config = parse_config({"model": {"path": "Qwen/Qwen3-8B"}}, base=tmp_path)
    assert config.model.path == HubModel("Qwen/Qwen3-8B") and config.model.download is False
    assert config.model_dump(mode="json")["model"]["path"] == "Qwen/Qwen3-8B"
    with pytest.raises(ConfigError, match="model.path: expected a folder or a Hugging Face id"):
        parse_config({"model": {"path": 3}})


def _env(tmp_path: Path, hub: FakeHub | None, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "DFLASH_SERVE_CPU"))}
    env |= {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONPATH": str(REPO), **more}
    env["HF_ENDPOINT"] = hub.url if hub is not None else "http://127.0.0.1:9"  # nothing listens there
    return env


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


def _config(tmp_path: Path, target: str, drafter: str, **model) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": target, "dtype": "float32", **model},
        "server": {"device": "cpu"},
        "speculative": {"algorithm": "dflash_adaptive", "draft_model_path": drafter}}))
    return path


def _check(env, config: Path) -> subprocess.CompletedProcess:
    return _run(env, "-m", "service.cli", "check", "--skip-sglang-args", "-c", str(config))


@pytest.fixture
def hub():
    if not (PAIR / "drafter" / "model.safetensors").is_file():
        pytest.skip("the bundled pair (models/tiny-code) is not in this checkout")
    with FakeHub() as h:
        h.add("tiny/target", PAIR / "target")
        h.add("tiny/drafter", PAIR / "drafter")
        yield h


def test_folder_download_resumes_and_is_verified(tmp_path, hub):
    """fetch_models into /models/<org>/<name>: an interrupted download leaves a half folder the preflight refuses,
    naming what is missing and the fix; running fetch_models again keeps every complete file, resumes a cut-off
    transfer (Range), and the folder then checks out file by file."""
    root = tmp_path / "models"
    config = _config(tmp_path, str(root / "tiny/target"), str(root / "tiny/drafter"))
    env = _env(tmp_path, hub)
    fetch = ("deploy/fetch_models.py", "-c", str(config), "--root", str(root))

    hub.broken.add("tiny/target/model.safetensors")  # the hub fails on the weights: the run stops
    r = _run(env, *fetch)
    assert r.returncode != 0 and "run it again" in r.stderr, r.stderr
    assert (root / "tiny/target/config.json").is_file()  # the half folder the old rule took for complete

    r = _check(env, config)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "model.path:" in r.stderr and "incomplete download of tiny/target" in r.stderr
    assert "model.safetensors: missing" in r.stderr and "deploy/fetch_models.py" in r.stderr

    hub.broken.clear()
    # the connection drops past huggingface_hub's first 10 MiB chunk, which it keeps: the rest is asked for by Range
    weights = hub.repos["tiny/target"][1]["model.safetensors"]
    assert len(weights) > 11 << 20
    hub.cut["tiny/target/model.safetensors"] = 11 << 20
    before = dict(hub.gets)
    r = _run(env, *fetch)
    assert r.returncode == 0, r.stderr
    again = {k: n - before.get(k, 0) for k, n in hub.gets.items() if n - before.get(k, 0)}
    assert not any(k.startswith("tiny/target/") and k != "tiny/target/model.safetensors" for k in again), again
    assert [k for k, r in hub.ranges if r.startswith("bytes=") and int(r[6:].split("-")[0]) >= 10 << 20] == [
        "tiny/target/model.safetensors"]

    r = _check(env, config)
    assert r.returncode == 0, r.stderr
    assert "files as the hub listed them" in r.stdout

    before = dict(hub.gets)  # complete: a second run touches nothing
    r = _run(env, *fetch)
    assert r.returncode == 0 and "complete in" in r.stdout and dict(hub.gets) == before

    tok = root / "tiny/target/tokenizer.json"  # same size, other bytes: found by the hash
    data = bytearray(tok.read_bytes())
    data[100] ^= 1
    tok.write_bytes(bytes(data))
    r = _check(env, config)
    assert r.returncode == 2 and "tokenizer.json: git blob id differs" in r.stderr, r.stderr


def test_hub_id_from_the_cache_downloaded_when_allowed_then_offline(tmp_path, hub):
    """A Hugging Face id: not in the cache and downloads off, an error naming the fix; with model.download the
    snapshot lands in the Hugging Face cache; with HF_HUB_OFFLINE and no hub at all it is served from there."""
    env = _env(tmp_path, hub)
    config = _config(tmp_path, "tiny/target", "tiny/drafter")
    r = _check(env, config)
    assert r.returncode == 2 and "model.path: tiny/target is not in the Hugging Face cache" in r.stderr, r.stderr
    assert "model.download: true" in r.stderr

    config = _config(tmp_path, "tiny/target", "tiny/drafter", download=True)
    resolve = ("-c", "from service.config import load_config; from service import launcher; "
                     f"c, notes = launcher.resolve_models(load_config({str(config)!r})); print(*notes, sep='\\n')")
    r = _run(env, *resolve)
    assert r.returncode == 0, r.stderr
    assert "model.path: tiny/target ->" in r.stdout and "downloaded" in r.stdout
    snapshots = tmp_path / "hf/hub/models--tiny--target/snapshots"
    assert [p.name for p in snapshots.iterdir()] == [hub.repos["tiny/target"][0]]

    offline = _env(tmp_path, None, HF_HUB_OFFLINE="1")
    r = _check(offline, config)
    assert r.returncode == 0, r.stderr
    assert f"ok: model.path: tiny/target -> {snapshots}" in r.stdout
    r = _run(offline, "-m", "service.cli", "serve", "--dry-run", "-c", str(config))
    assert r.returncode == 0, r.stderr
    assert str(snapshots) in r.stdout and "--served-model-name tiny/target" in r.stdout

    other = _config(tmp_path, "tiny/other", "tiny/drafter", download=True)
    r = _check(offline, other)
    assert r.returncode == 2 and "HF_HUB_OFFLINE is set" not in r.stderr  # check never downloads
    r = _run(offline, *resolve[:1], resolve[1].replace(str(config), str(other)))
    assert r.returncode != 0 and "tiny/other is not in the Hugging Face cache" in r.stderr
    assert "HF_HUB_OFFLINE is set" in r.stderr
