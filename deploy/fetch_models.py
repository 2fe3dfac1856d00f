#!/usr/bin/env python3
"""Download the models a dflash-serve config names, before the server starts (compose's `model-fetch` service).

A model path under the models root (default /models) names its Hugging Face repository: /models/Qwen/Qwen3-8B
is downloaded from Qwen/Qwen3-8B, /models/z-lab/Qwen3-8B-DFlash-b16 from z-lab/Qwen3-8B-DFlash-b16. A directory
that already holds a config.json is left alone (pre-provisioned weights, or an earlier run), so a restart is
instant and needs no network. Paths outside the root (the CPU image's bundled pair) are not touched. Gated
repositories read the token from HF_TOKEN, as huggingface_hub always does.

    python3 deploy/fetch_models.py --config deploy/configs/gpu-qwen3-8b-docker.yaml [--root /models] [--dry-run]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Weights formats the server never reads; skipping them halves some downloads.
IGNORE_PATTERNS = ["*.pth", "*.gguf", "original/*"]


def wanted(config_path: str | Path, root: str | Path = "/models") -> list[tuple[str, str, Path]]:
    """(config field, Hugging Face repo id, directory) for each model path of the config under `root`."""
    from service.config import load_config

    config = load_config(config_path)
    root = Path(root)
    fields = [("model.path", config.model.path), ("model.tokenizer", config.model.tokenizer)]
    if config.speculative.algorithm != "none":
        fields.append(("speculative.draft_model_path", config.speculative.draft_model_path))
    out = []
    for field, path in fields:
        if path is None or not path.is_relative_to(root):
            continue
        repo = path.relative_to(root).as_posix()
        if repo.count("/") != 1:
            raise SystemExit(f"fetch_models: {field}: {path} is under {root} but is not {root}/<org>/<name>, "
                             f"so it names no Hugging Face repository")
        if all(p != path for _, _, p in out):
            out.append((field, repo, path))
    return out


def fetch(items: list[tuple[str, str, Path]], dry_run: bool = False, download=None) -> list[str]:
    """Download what is missing; returns the repo ids downloaded (or, with dry_run, that would be)."""
    fetched = []
    for field, repo, path in items:
        if (path / "config.json").is_file():
            print(f"fetch_models: {field}: {path} already present", flush=True)
            continue
        print(f"fetch_models: {field}: downloading {repo} -> {path}", flush=True)
        fetched.append(repo)
        if dry_run:
            continue
        if download is None:
            from huggingface_hub import snapshot_download as download
        path.mkdir(parents=True, exist_ok=True)
        download(repo_id=repo, local_dir=str(path), ignore_patterns=IGNORE_PATTERNS)
    return fetched


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", "-c", required=True, help="dflash-serve YAML config")
    p.add_argument("--root", default="/models", help="models root whose subpaths name HF repos (default /models)")
    p.add_argument("--dry-run", action="store_true", help="print what would be downloaded")
    a = p.parse_args(argv)
    from service.config import ConfigError

    try:
        items = wanted(a.config, a.root)
    except ConfigError as e:
        print(f"fetch_models: error: {e}", file=sys.stderr)
        return 2
    fetch(items, dry_run=a.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
