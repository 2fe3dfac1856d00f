"""Prompt sets for the load test: the bundled mix, OpenAI and ShareGPT JSONL, and errors that name the line."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from loadtest.dataset import BUNDLED, DatasetError, load_prompts


def write(tmp_path, *lines: object):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_bundled_mix_is_mostly_python_code_with_some_math_and_chat():
    prompts = load_prompts()
    assert len(prompts) >= 50
    assert all(p[-1]["role"] == "user" and p[-1]["content"] for p in prompts)
    cats = Counter(json.loads(line)["category"] for line in BUNDLED.read_text().splitlines())
    assert cats["code"] > len(prompts) / 2 and cats["math"] >= 5 and cats["chat"] >= 5


def test_openai_format_is_sent_as_written_minus_the_reference_answer(tmp_path):
    convo = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
             {"role": "assistant", "content": "6"}]
    assert load_prompts(write(tmp_path, {"messages": convo, "id": 7})) == [convo[:4]]


def test_sharegpt_format_uses_the_first_human_turn(tmp_path):
    line = {"id": "x", "conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "hi"},
                                         {"from": "gpt", "value": "hello"}, {"from": "human", "value": "more"}]}
    assert load_prompts(write(tmp_path, line)) == [[{"role": "system", "content": "sys"},
                                                    {"role": "user", "content": "hi"}]]


def test_formats_mix_and_blank_lines_are_skipped(tmp_path):
    path = write(tmp_path, {"messages": [{"role": "user", "content": "a"}]}, "",
                 {"conversations": [{"from": "human", "value": "b"}]})
    assert [p[-1]["content"] for p in load_prompts(path)] == ["a", "b"]


@pytest.mark.parametrize("bad, why", [
    ("{not json", "not JSON"),
    ('["a list"]', "not an object"),
    ({"prompt": "hi"}, "neither 'messages' nor 'conversations'"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\]"),
    ({"messages": [{"role": "user", "content": 5}]}, r"messages\[0\]"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "no user message"),
    ({"conversations": [{"from": "gpt", "value": "x"}]}, "no human turn"),
    ({"conversations": [{"from": "human"}]}, r"conversations\[0\]"),
])
def test_a_bad_line_names_the_file_and_line(tmp_path, bad, why):
    path = write(tmp_path, {"messages": [{"role": "user", "content": "fine"}]}, bad)
    with pytest.raises(DatasetError, match=why) as e:
        load_prompts(path)
    assert str(e.value).startswith(f"{path}:2: ")


def test_missing_or_empty_dataset_says_so(tmp_path):
    with pytest.raises(DatasetError, match="cannot read"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DatasetError, match="no conversations"):
        load_prompts(tmp_path / "empty.jsonl")
