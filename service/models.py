"""Where the models come from: a folder, or a Hugging Face id resolved through the local Hugging Face cache.

A model field (`model.path`, `model.tokenizer`, `speculative.draft_model_path`) names a folder, or a Hugging Face
id `org/name` (optionally `org/name@revision`) when no folder of that name exists next to the config. An id is
read from the local cache (HF_HOME / HF_HUB_CACHE) and downloaded only where the config allows it
(`model.download: true`), with huggingface_hub's snapshot download, which keeps every file already complete and
resumes a cut-off transfer.

A download is complete only when every file of the snapshot is there with the size the hub listed, and with the
hash it listed (the sha256 of an LFS file; the git blob id of any other): before downloading, the hub's listing of
the snapshot is written beside it (`record_dir`), so a download cut off at any point -- config.json already there,
weights not -- is found and named, by the preflight and by `deploy/fetch_models.py`, which finishes it. A folder
nobody downloaded this way (weights copied in by the operator) has no listing and is taken as it is.

huggingface_hub is imported only where an id is resolved or a download runs, never for a folder.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# Weights formats the server never reads; skipping them halves some downloads.
IGNORE_PATTERNS = ["*.pth", "*.gguf", "original/*"]

_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(@(?P<rev>[A-Za-z0-9._/-]+))?")
RECORD = "snapshot.json"  # the hub's listing of the snapshot, written before the download
STAMPS = "verified.json"  # files whose hash was checked, by size and mtime, so it is checked once


class ModelsError(ValueError):
    """A model that is not there, or not whole: phrased for the config error that names its field."""


@dataclass(frozen=True)
class HubModel:
    """A Hugging Face id as the config wrote it: `repo_id`, and a revision (branch, tag or commit) or None (main)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_ref(value: str, base: Path | None) -> Path | HubModel:
    """A model field's value: a folder (absolute, `./`, `../`, `~`, or an existing folder relative to `base`, the
    config's folder), else a Hugging Face id when it has that form, else a folder (which the preflight will say is
    not there)."""
    text = os.path.expanduser(str(value))
    path = Path(text)
    local = path if path.is_absolute() or base is None else (Path(base) / path).resolve()
    m = _HUB_ID.fullmatch(str(value))
    if m is None or str(value).startswith((".", "~")) or local.is_dir():
        return local
    return HubModel(m.group("repo"), m.group("rev"))


# ------------------------------------------------------------------------------------------------ the listing
@dataclass(frozen=True)
class ListedFile:
    path: str
    size: int
    sha256: str | None = None  # LFS files
    blob_id: str | None = None  # the git blob id: every other file


def record_dir(folder: Path) -> Path:
    """Where a snapshot's listing lives: beside huggingface_hub's own metadata, outside the files the server reads
    (`<folder>/.cache/dflash-serve/`; in the Hugging Face cache, `<repo>/dflash-serve/<commit>/`, next to its
    `snapshots/`)."""
    folder = Path(folder)
    if folder.parent.name == "snapshots" and (folder.parent.parent / "blobs").is_dir():
        return folder.parent.parent / "dflash-serve" / folder.name
    return folder / ".cache" / "dflash-serve"


def write_record(folder: Path, repo_id: str, commit: str, files: list[ListedFile]) -> None:
    where = record_dir(folder)
    where.mkdir(parents=True, exist_ok=True)
    data = {"repo_id": repo_id, "commit": commit,
            "files": {f.path: {"size": f.size, "sha256": f.sha256, "blob_id": f.blob_id} for f in files}}
    tmp = where / (RECORD + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(where / RECORD)


def read_record(folder: Path) -> dict | None:
    path = record_dir(folder) / RECORD
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def _git_blob_id(path: Path) -> str:
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def problems(folder: Path, record: dict | None = None) -> list[str]:
    """What keeps `folder` from being the snapshot its listing names, one line per file ([] when whole). Hashes
    are checked once per file version: a file checked before, with the same size and mtime, is not read again."""
    folder = Path(folder)
    record = read_record(folder) if record is None else record
    if record is None:
        return []
    stamps_path = record_dir(folder) / STAMPS
    try:
        stamps = json.loads(stamps_path.read_text()) if stamps_path.is_file() else {}
    except ValueError:
        stamps = {}
    out, changed = [], False
    for name, want in sorted(record["files"].items()):
        path = folder / name
        if not path.is_file():
            out.append(f"{name}: missing ({_size(want['size'])})")
            continue
        st = path.stat()
        if st.st_size != want["size"]:
            out.append(f"{name}: {_size(st.st_size)} of {_size(want['size'])}")
            continue
        stamp = [st.st_size, st.st_mtime_ns]
        if stamps.get(name) == stamp:
            continue
        if want.get("sha256"):
            ok, what = _sha256(path) == want["sha256"], "sha256"
        elif want.get("blob_id"):
            ok, what = _git_blob_id(path) == want["blob_id"], "git blob id"
        else:
            ok, what = True, ""
        if not ok:
            out.append(f"{name}: {what} differs from the hub's")
            continue
        stamps[name], changed = stamp, True
    if changed:
        try:  # a read-only volume: the hashes are checked again next time, which costs time only
            stamps_path.write_text(json.dumps(stamps) + "\n")
        except OSError:
            pass
    return out


def incomplete_message(field: str, folder: Path, record: dict, missing: list[str], fix: str) -> str:
    shown = "; ".join(missing[:4]) + (f"; and {len(missing) - 4} more" if len(missing) > 4 else "")
    return (f"{field}: {folder} is an incomplete download of {record['repo_id']} (commit {record['commit'][:12]}): "
            f"{len(missing)} of {len(record['files'])} files not as the hub lists them: {shown}; {fix}")


# ------------------------------------------------------------------------------------------------ downloads
def download(repo_id: str, revision: str | None = None, local_dir: Path | None = None,
             log: Callable[[str], None] = print) -> Path:
    """Download a snapshot (into `local_dir`, or the Hugging Face cache) and verify it; returns its folder.

    The hub's listing is written first, so an interrupted run is found incomplete later; huggingface_hub keeps the
    files already complete and resumes a cut-off transfer, so running this again finishes the download."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    api = HfApi()
    commit = api.repo_info(repo_id, revision=revision).sha
    listing = [f for f in api.list_repo_tree(repo_id, revision=commit, recursive=True) if isinstance(f, RepoFile)]
    keep = set(filter_repo_objects([f.path for f in listing], ignore_patterns=IGNORE_PATTERNS))
    files = [ListedFile(f.path, f.size, f.lfs.sha256 if f.lfs else None, None if f.lfs else f.blob_id)
             for f in listing if f.path in keep]
    if local_dir is None:
        from huggingface_hub import constants

        repo_folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
        folder = repo_folder / "snapshots" / commit
        (folder.parent.parent / "blobs").mkdir(parents=True, exist_ok=True)
    else:
        folder = Path(local_dir)
        folder.mkdir(parents=True, exist_ok=True)
    write_record(folder, repo_id, commit, files)
    total = sum(f.size for f in files)
    log(f"downloading {repo_id} (commit {commit[:12]}, {len(files)} files, {_size(total)}) -> {folder}")
    # The revision as written (a branch keeps its ref in the cache, for offline use later); the listing is the
    # commit's, and a folder of another commit is refused below.
    got = Path(snapshot_download(repo_id, revision=revision, local_dir=None if local_dir is None else str(folder),
                                 ignore_patterns=IGNORE_PATTERNS))
    if got.resolve() != folder.resolve():
        raise ModelsError(f"{repo_id} moved to a new commit during the download ({got.name}, listed {commit}); "
                          f"run it again")
    missing = problems(folder)
    if missing:
        raise ModelsError(incomplete_message(repo_id, folder, read_record(folder) or {}, missing,
                                             "run the download again: it keeps what is complete"))
    return folder


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cached(ref: HubModel) -> tuple[Path | None, bool]:
    """The id's snapshot folder in the local cache (its revision's ref) or None, and whether huggingface_hub
    found it whole as far as it can tell; never the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(ref.repo_id, revision=ref.revision, local_files_only=True,
                                      ignore_patterns=IGNORE_PATTERNS)), True
    except LocalEntryNotFoundError as e:  # an incomplete snapshot too, where huggingface_hub can tell
        folder = getattr(e, "snapshot_path", None)
        return (Path(folder) if folder else None), False


def cache_root() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


# ------------------------------------------------------------------------------------------------ a config
FETCH_FIX = "`python3 deploy/fetch_models.py -c <this config>` downloads what is missing and keeps the rest"


def resolve_ref(field: str, ref: Path | HubModel, *, download: bool, notes: list[str] | None = None) -> Path:
    """`ref` as a folder: an id from the cache (downloaded when `download`), a folder checked against its
    listing when it has one. Raises ModelsError naming `field` and the fix."""
    notes = [] if notes is None else notes
    if isinstance(ref, HubModel):
        folder, whole = cached(ref)
        record = read_record(folder) if folder is not None else None
        missing = problems(folder, record) if record else []
        if folder is not None and not missing and (whole or record):
            notes.append(f"{field}: {ref} -> {folder} (" + (f"{len(record['files'])} files as the hub listed them"
                         if record else "from the cache; no listing of a download by dflash-serve") + ")")
            return folder
        if not download or offline():
            if folder is None:
                where = (f"is not in the Hugging Face cache ({cache_root()}; a folder is written ./{ref.repo_id} "
                         f"or as an absolute path)")
            else:
                where = f"is only partly in the Hugging Face cache ({folder}" + (
                    f": {'; '.join(missing[:4])})" if missing else ")")
            why = " and HF_HUB_OFFLINE is set" if download else ""
            raise ModelsError(f"{field}: {ref} {where}{why}; set model.download: true to download it at start, "
                              f"or {FETCH_FIX}")
        folder = download_or_raise(field, ref)
        notes.append(f"{field}: {ref} -> {folder} (downloaded, every file as the hub listed it)")
        return folder
    record = read_record(ref) if ref.is_dir() else None
    if record is not None:
        missing = problems(ref, record)
        if missing:
            raise ModelsError(incomplete_message(field, ref, record, missing, FETCH_FIX))
        notes.append(f"{field}: {ref} ({record['repo_id']}, {len(record['files'])} files as the hub listed them)")
    return ref


def download_or_raise(field: str, ref: HubModel, local_dir: Path | None = None) -> Path:
    try:
        return download(ref.repo_id, ref.revision, local_dir, log=lambda m: print(f"dflash-serve: {field}: {m}",
                                                                                  flush=True))
    except ModelsError as e:
        raise ModelsError(f"{field}: {e}") from None
    except Exception as e:  # the hub's errors (not found, gated, network): one line naming the field
        raise ModelsError(f"{field}: downloading {ref} failed: {type(e).__name__}: {str(e).splitlines()[0]}") from None


def resolve(config, *, download: bool | None = None):
    """`config` (a ServeConfig) with every model field a folder, and a note per model for `dflash-serve check`.
    `download`: whether an id missing from the cache may be downloaded (default: `model.download`)."""
    allow = config.model.download if download is None else download and config.model.download
    notes: list[str] = []
    m, spec = config.model, config.speculative
    update_model = {"path": resolve_ref("model.path", m.path, download=allow, notes=notes)}
    if m.tokenizer is not None:
        update_model["tokenizer"] = resolve_ref("model.tokenizer", m.tokenizer, download=allow, notes=notes)
    if m.served_name is None and isinstance(m.path, HubModel):
        update_model["served_name"] = str(m.path)  # clients name the model as the config did, not a cache folder
    update = {"model": m.model_copy(update=update_model)}
    if spec.algorithm != "none" and spec.draft_model_path is not None:
        drafter = resolve_ref("speculative.draft_model_path", spec.draft_model_path, download=allow, notes=notes)
        update["speculative"] = spec.model_copy(update={"draft_model_path": drafter})
    return config.model_copy(update=update), notes
