"""The capture store: served requests' token ids, kept for `dflash-serve learn` (docs/LEARNING.md).

Why a background writer: the scheduler hands a finished request over (`CaptureWriter.offer`, a non-blocking queue
put) and never touches the disk; a full queue drops the request and counts it. The writer thread appends JSON lines
to the current segment and enforces the limits.

On disk (the contract with the reader, dflash_models/learn/store.py): ``<store_dir>/seg-<ns>.jsonl``, one request a
line, ``{"t": unix seconds, "p": [prompt ids], "o": [output ids], "s": sampled}``. Token ids only: no text, no
request id, no client identity. The directory is 0700 and the files 0600. A segment closes at ``segment_bytes``;
segments older than ``max_age_seconds`` and the oldest beyond ``max_store_bytes`` (the open one included) are
deleted, at start and whenever a segment closes or a minute has passed. Nothing here logs token ids.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from pathlib import Path

from sglang_ext.settings import CaptureSettings

logger = logging.getLogger(__name__)

SEGMENT_GLOB = "seg-*.jsonl"
_PRUNE_EVERY_S = 60.0


def segments(store_dir: Path) -> list[Path]:
    """The store's segments, oldest first (their names sort by creation time)."""
    return sorted(Path(store_dir).glob(SEGMENT_GLOB))


def prune(store_dir: Path, max_bytes: int, max_age_s: float, now: float | None = None) -> int:
    """Delete segments past the age limit, then the oldest until the store fits ``max_bytes``; returns how many."""
    now = time.time() if now is None else now
    deleted = 0
    kept: list[tuple[Path, int]] = []
    for seg in segments(store_dir):
        try:
            st = seg.stat()
        except FileNotFoundError:
            continue
        if now - st.st_mtime > max_age_s:
            seg.unlink(missing_ok=True)
            deleted += 1
        else:
            kept.append((seg, st.st_size))
    total = sum(size for _, size in kept)
    for seg, size in kept:
        if total <= max_bytes:
            break
        seg.unlink(missing_ok=True)
        total -= size
        deleted += 1
    return deleted


class CaptureWriter:
    """A bounded queue and the one thread that appends it to the store."""

    def __init__(self, settings: CaptureSettings) -> None:
        self.settings = settings
        self.dir = Path(settings.store_dir)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._queue: queue.Queue = queue.Queue(maxsize=settings.queue_max)
        self.captured = 0
        self.dropped = 0
        self._file = None
        self._path: Path | None = None
        self._size = 0
        self._last_prune = 0.0
        self._stop = threading.Event()
        prune(self.dir, settings.max_store_bytes, settings.max_age_seconds)
        self._thread = threading.Thread(target=self._run, name="dflash-capture", daemon=True)
        self._thread.start()

    def offer(self, prompt_ids, output_ids, sampled: bool) -> bool:
        """Queue one finished request (never blocks); False when the queue is full and it was dropped."""
        try:
            self._queue.put_nowait((time.time(), list(prompt_ids), list(output_ids), bool(sampled)))
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, then stop (tests; the scheduler's exit just ends the daemon thread)."""
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout)

    def _open(self):
        path = self.dir / f"seg-{time.time_ns():020d}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._path = path
        self._size = 0
        return os.fdopen(fd, "a", encoding="utf-8")

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=_PRUNE_EVERY_S)
            except queue.Empty:
                item = False
            try:
                if item:
                    self._write(item)
                    while True:  # drain what else is queued before one flush
                        try:
                            nxt = self._queue.get_nowait()
                        except queue.Empty:
                            break
                        if nxt is None:
                            item = None
                            break
                        self._write(nxt)
                    if self._file is not None:
                        self._file.flush()
                if time.monotonic() - self._last_prune > _PRUNE_EVERY_S:
                    self._prune()
            except Exception as e:  # noqa: BLE001 -- a full or read-only disk loses captures, never the server
                # the type only: the message could carry what was being written
                logger.warning("dflash capture: write failed (%s); the request is not kept", type(e).__name__)
                self._file = None
            if item is None:
                if self._file is not None:
                    self._file.close()
                return

    def _write(self, item) -> None:
        t, prompt, output, sampled = item
        line = json.dumps({"t": round(t, 3), "p": prompt, "o": output, "s": sampled}, separators=(",", ":")) + "\n"
        if self._file is None or self._size >= self.settings.segment_bytes:
            if self._file is not None:
                self._file.close()
            self._file = self._open()
            self._prune()
        self._file.write(line)
        self._size += len(line)
        self.captured += 1

    def _prune(self) -> None:
        self._last_prune = time.monotonic()
        prune(self.dir, self.settings.max_store_bytes, self.settings.max_age_seconds)
        if self._file is not None and self._path is not None and not self._path.exists():
            self._file.close()  # the open segment alone was over the limit: start a new one
            self._file = None
