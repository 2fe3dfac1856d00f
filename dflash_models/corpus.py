"""The training corpus: the running interpreter's own standard-library sources.

Nothing is downloaded, and the file list is sorted, so every machine with the same
Python version builds the same corpus. Installed packages (site-packages) and the
stdlib's own test suites are left out: they differ between machines or are mostly data.
"""
from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

_EXCLUDED_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """Sorted .py files of the stdlib at `root` (default: this interpreter's)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _EXCLUDED_PARTS.intersection(p.relative_to(root).parts)]
    if not files:
        raise FileNotFoundError(f"no Python sources under {root}: pass the stdlib directory explicitly")
    return sorted(files)


@dataclass(frozen=True)
class Split:
    train: list[Path]
    heldout: list[Path]


def split_files(files: list[Path], heldout_fraction: float = 0.05) -> Split:
    """Held-out split by file, decided by a hash of the file's name so it is stable
    when files are added or removed (no RNG state to carry)."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    cut = int(heldout_fraction * 10_000)
    held = [f for f in files if zlib.crc32(f.name.encode()) % 10_000 < cut]
    train = [f for f in files if zlib.crc32(f.name.encode()) % 10_000 >= cut]
    return Split(train=train, heldout=held)


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")
