#!/usr/bin/env python3
"""Download the models a dflash-serve config names, before the server starts (compose's `model-fetch` service).

A model path under the models root (default /models) names its Hugging Face repository: /models/Qwen/Qwen3-8B
is downloaded from Qwen/Qwen3-8B, /models/z-lab/Qwen3-8B-DFlash-b16 from z-lab/Qwen3-8B-DFlash-b16. A model given
by Hugging Face id (`model.path: Qwen/Qwen3-8B`) is downloaded into the local Hugging Face cache, where the server
reads it. A download is complete only when every file the hub lists for the snapshot is there with its size and
hash (service/models.py); a complete one is left alone, so a restart is instant and needs no network, and an
interrupted one is finished: the files already complete are kept, a cut-off one resumed. A folder with no
download record (weights put there by the operator) and paths outside the root (the CPU image's bundled pair) are
not touched. Gated repositories read the token from HF_TOKEN, as huggingface_hub always does.

    python3 deploy/fetch_models.py --config deploy/configs/gpu-qwen3-8b-docker.yaml [--root /models] [--dry-run]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (compose, the k8s Job): the checkout's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service import models  # noqa: E402

IGNORE_PATTERNS = models.IGNORE_PATTERNS


def wanted(config_path: str | Path, root: str | Path = "/models") -> list[tuple[str, str, Path | None]]:
    """(config field, Hugging Face id, folder) for each model of the config to download: a folder under `root`
    (named after its repository), or an id (folder None: the Hugging Face cache)."""
    from service.config import load_config

    config = load_config(config_path)
    root = Path(root)
    fields = [("model.path", config.model.path), ("model.tokenizer", config.model.tokenizer)]
    if config.speculative.algorithm != "none":
        fields.append(("speculative.draft_model_path", config.speculative.draft_model_path))
    out: list[tuple[str, str, Path | None]] = []
    for field, ref in fields:
        if isinstance(ref, models.HubModel):
            if all(r != str(ref) or p is not None for _, r, p in out):
                out.append((field, str(ref), None))
            continue
        if ref is None or not ref.is_relative_to(root):
            continue
        repo = ref.relative_to(root).as_posix()
        if repo.count("/") != 1:
            raise SystemExit(f"fetch_models: {field}: {ref} is under {root} but is not {root}/<org>/<name>, "
                             f"so it names no Hugging Face repository")
        if all(p != ref for _, _, p in out):
            out.append((field, repo, ref))
    return out


def _state(ref: models.HubModel, folder: Path | None) -> tuple[str, list[str]]:
    """("complete" | "provided" | "download", what is missing) for one model, without the network."""
    if folder is None:
        folder, _ = models.cached(ref)
        if folder is None:
            return "download", ["not in the Hugging Face cache"]
    record = models.read_record(folder)
    if record is None:
        weights = (folder / "config.json").is_file() and not (folder / ".cache" / "huggingface").is_dir()
        if weights and folder.parent.name != "snapshots":
            return "provided", []
        return "download", ["no record of a complete download"]
    missing = models.problems(folder, record)
    return ("download" if missing else "complete"), missing


def fetch(items: list[tuple[str, str, Path | None]], dry_run: bool = False) -> list[str]:
    """Download what is not complete; returns the ids downloaded (or, with dry_run, that would be)."""
    fetched = []
    for field, repo, folder in items:
        repo_id, _, revision = repo.partition("@")
        ref = models.HubModel(repo_id, revision or None)
        where = folder or "the Hugging Face cache"
        state, missing = _state(ref, folder)
        if state == "complete":
            print(f"fetch_models: {field}: {repo} complete in {where}", flush=True)
            continue
        if state == "provided":
            print(f"fetch_models: {field}: {folder} holds a model nobody downloaded here: left as it is", flush=True)
            continue
        shown = "; ".join(missing[:4]) + (f"; and {len(missing) - 4} more" if len(missing) > 4 else "")
        print(f"fetch_models: {field}: {repo} -> {where}: {shown}", flush=True)
        fetched.append(repo)
        if not dry_run:
            try:
                models.download(ref.repo_id, ref.revision, folder, log=lambda m: print(f"fetch_models: {m}",
                                                                                        flush=True))
            except models.ModelsError as e:
                raise SystemExit(f"fetch_models: {field}: {e}") from None
            except Exception as e:  # the hub's and the network's errors: one line, and what to do
                raise SystemExit(f"fetch_models: {field}: downloading {repo} failed ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}); run it again: the files already "
                                 f"complete are kept") from None
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
