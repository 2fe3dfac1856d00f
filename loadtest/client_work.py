"""A CPU-heavy client: re-tokenize the whole answer received so far on every streamed chunk.

Third-party LLM benchmark clients count output tokens this way, with a Hugging Face tokenizer in the load
generator's own process. On a machine the client shares with the server (this repository's 2-core CI box) that
work competes with the server for the cores: `loadtest/chat.py --client-tokenizer DIR` reproduces it, and reports
what it cost per chunk (the `client_tokenize` metric) so a run can say how much of the machine the client took.
"""
from __future__ import annotations

import select
import sys
import time
from pathlib import Path


class ClientTokenizerError(ValueError):
    """The tokenizer directory cannot be loaded; the message names it and the fix."""


def load_tokenizer(directory: str | Path):
    """The Hugging Face tokenizer in `directory` (transformers' AutoTokenizer, as those clients load it)."""
    path = Path(directory)
    if not path.is_dir():
        raise ClientTokenizerError(f"{path}: not a directory; pass a Hugging Face model or tokenizer directory "
                                   f"(the bundled one: models/tiny-code/target)")
    AutoTokenizer = _import_auto_tokenizer()
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        why = " ".join(str(e).split())[:200]    # one line: it ends up in a command-line error
        raise ClientTokenizerError(f"{path}: no Hugging Face tokenizer there ({why}); pass a model or "
                                   f"tokenizer directory (the bundled one: models/tiny-code/target)") from None


class Retokenizer:
    """One request's client work: `on_text(text_so_far)` (the stream parser's hook) re-tokenizes the whole text
    and keeps what it took, in ms per chunk."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.costs_ms: list[float] = []
        self.tokens = 0               # tokens of the text so far, as the client counts them

    def on_text(self, text: str) -> None:
        start = time.perf_counter()
        self.tokens = len(self.tokenizer.encode(text, add_special_tokens=False))
        self.costs_ms.append((time.perf_counter() - start) * 1e3)


def _import_auto_tokenizer():
    """transformers' AutoTokenizer, importable under Locust's gevent patching too.

    gevent's patch removes `select.epoll`, and transformers' import chain (huggingface_hub -> trio) reads it at
    import time, so the import fails inside Locust. The real epoll is put back for the import only: nothing
    here runs trio's event loop. Retired by trio no longer touching `select.epoll` at import.
    """
    monkey = sys.modules.get("gevent.monkey")
    restore = monkey is not None and not hasattr(select, "epoll") and monkey.is_module_patched("select")
    if restore:
        select.epoll = monkey.get_original("select", "epoll")
    try:
        from transformers import AutoTokenizer
    finally:
        if restore:
            del select.epoll
    return AutoTokenizer
