"""The CPU-heavy client's work (loadtest/client_work.py): the whole text so far, re-tokenized on every chunk."""
from __future__ import annotations

import pytest

from loadtest.client_work import ClientTokenizerError, Retokenizer, load_tokenizer
from tests.conftest import BUNDLED


def test_every_chunk_retokenizes_the_whole_text_so_far():
    tok = load_tokenizer(BUNDLED / "target")
    work = Retokenizer(tok)
    text = ""
    for piece in ("def add", "(a, b):\n", "    return a + b\n"):
        text += piece
        work.on_text(text)
    assert len(work.costs_ms) == 3 and all(ms > 0 for ms in work.costs_ms)
    assert work.tokens == len(tok.encode(text, add_special_tokens=False))


def test_a_directory_without_a_tokenizer_is_named_with_the_fix(tmp_path):
    with pytest.raises(ClientTokenizerError, match=f"{tmp_path}: no Hugging Face tokenizer there.*models/tiny-code"):
        load_tokenizer(tmp_path)
    with pytest.raises(ClientTokenizerError, match="not a directory"):
        load_tokenizer(tmp_path / "nope")
