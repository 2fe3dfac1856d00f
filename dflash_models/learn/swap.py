"""Hot swap: load a drafter version into running servers through SGLang's weight-update API (0.5.23).

Per server, with the admin key (the routes are admin-only under dflash-serve: sglang_ext/patches/http_guard.py):
  POST /pause_generation          {"mode": "in_place"}   (running requests stay; no step runs mid-update)
  POST /begin_weight_update        {"selector": "draft"}
  POST /update_weights_from_tensor {"selector": "draft", "serialized_named_tensors": [b64 pickle], "flush_cache":
                                    false, "weight_version": <version> on the last chunk}   (chunks: the body limit)
  POST /end_weight_update          {}
  POST /continue_generation        {}
`/update_weights_from_disk` cannot serve: it takes no selector and loads one path into the target and the draft.
The tensors travel as a plain pickle of (name, bf16 tensor) pairs, which SGLang's SafeUnpickler accepts (no
shared-memory handles: the learner is another process, maybe another machine). `flush_cache` is false: a flush is
refused while requests run, and the weights are updated between two scheduler steps, so in-flight requests continue
(their draft KV is kept: sglang_ext/worker.py drafter_swapped). Afterwards a best-effort /flush_cache drops cached
prefixes (and the draft KV the old drafter wrote for them) when the server happens to be idle.
A learner killed between the pause and the resume leaves the server paused only until its pause lease lapses
(`server.pause_lease_seconds` without a call): the server then rolls back the open session and resumes
(sglang_ext/patches/pause_lease.py). So the calls follow each other with no pause between them.
"""
from __future__ import annotations

import base64
import json
import pickle
import urllib.error
import urllib.request
from pathlib import Path


class SwapError(RuntimeError):
    pass


def _post(url: str, body: dict, admin_key: str | None, timeout: float) -> dict:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    if admin_key:
        req.add_header("Authorization", f"Bearer {admin_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        raise SwapError(f"{url}: HTTP {e.code}: {e.read()[:300].decode(errors='replace')}") from None
    except OSError as e:
        raise SwapError(f"{url}: {e}") from None
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {"text": raw.decode(errors="replace")}


CHUNK_BYTES = 1024 * 1024  # raw tensor bytes per update call: base64 and JSON stay under the 2 MiB body limit


def payloads(drafter_dir: str | Path, chunk_bytes: int = CHUNK_BYTES) -> list[str]:
    """The drafter's weights as update_weights_from_tensor payloads (base64 of a plain pickle of (name, tensor)
    pairs, bf16 as stored: the server converts to its dtype exactly), each at most ~`chunk_bytes` of tensors."""
    from safetensors.torch import load_file

    chunks: list[list] = [[]]
    size = 0
    for name, t in sorted(load_file(str(Path(drafter_dir) / "model.safetensors")).items()):
        n = t.numel() * t.element_size()
        if chunks[-1] and size + n > chunk_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append((name, t))
        size += n
    return [base64.b64encode(pickle.dumps(c)).decode() for c in chunks]


def push(server: str, drafter_dir: str | Path, version: str, admin_key: str | None, timeout: float = 120.0,
         encoded: list[str] | None = None) -> dict:
    """Load `drafter_dir` into one server's draft model as `version`. Raises SwapError naming the step.

    Generation is paused in place around the update (`/pause_generation` mode in_place): running requests stay in
    the batch, no decode step runs on a half-loaded drafter, and they continue after `/continue_generation`."""
    base = server.rstrip("/")
    encoded = encoded or payloads(drafter_dir)
    _post(f"{base}/pause_generation", {"mode": "in_place"}, admin_key, timeout)
    try:
        r = _post(f"{base}/begin_weight_update", {"selector": "draft"}, admin_key, timeout)
        if not r.get("success", False):
            raise SwapError(f"{base}/begin_weight_update: {r.get('message')}")
        try:
            for i, chunk in enumerate(encoded):
                last = i == len(encoded) - 1  # the version names the drafter once it is whole
                r = _post(f"{base}/update_weights_from_tensor",
                          {"serialized_named_tensors": [chunk], "selector": "draft", "flush_cache": False,
                           "weight_version": version if last else None}, admin_key, timeout)
                if not r.get("success", False):
                    raise SwapError(f"{base}/update_weights_from_tensor: {r.get('message')}")
        finally:
            _post(f"{base}/end_weight_update", {}, admin_key, timeout)
    finally:
        _post(f"{base}/continue_generation", {}, admin_key, timeout)
    flushed = True
    try:
        _post(f"{base}/flush_cache", {}, admin_key, timeout)
    except SwapError:  # requests running: their cached prefixes keep the old drafter's draft KV until evicted
        flushed = False
    return {"server": base, "version": version, "cache_flushed": flushed}


def push_all(servers: list[str], drafter_dir: str | Path, version: str, admin_key: str | None) -> list[dict]:
    """Every replica, one after the other; the first failure stops and is raised (the ones done keep the version:
    the caller rolls them back or retries)."""
    encoded = payloads(drafter_dir)
    return [push(s, drafter_dir, version, admin_key, encoded=encoded) for s in servers]


def draft_checksum(server: str, admin_key: str | None, timeout: float = 60.0) -> str:
    """SGLang's checksum of the draft model's weights (/weights_checker), to prove which weights serve."""
    r = _post(f"{server.rstrip('/')}/weights_checker", {"action": "checksum", "selector": "draft"}, admin_key, timeout)
    if not r.get("success", False):
        raise SwapError(f"{server}/weights_checker: {r.get('message')}")
    return str(r.get("per_engine_checksum") or r.get("ranks"))
