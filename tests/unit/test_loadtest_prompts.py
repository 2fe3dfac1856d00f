"""Prompt sets for the load test: the bundled sets, OpenAI chat, ShareGPT and completion JSONL, per-line
temperatures, and errors that name the line and the field."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from loadtest import make_chat, make_mixed, make_traffic
from loadtest.dataset import BUNDLED, DatasetError, Request, load_prompts, load_requests

PROMPTS = BUNDLED.parent


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
    ({"promt": "hi"}, "none of 'messages', 'conversations' or 'prompt'"),
    ({"prompt": ""}, "'prompt' must be a non-empty string"),
    ({"prompt": ["a", "b"]}, "'prompt' must be a non-empty string"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "both 'messages' and 'prompt'"),
    ({"prompt": "x", "temperature": -1}, "'temperature' must be a number >= 0"),
    ({"messages": [{"role": "user", "content": "y"}], "temperature": "hot"}, "'temperature' must be a number >= 0"),
    ({"prompt": "x", "temperature": True}, "'temperature' must be a number >= 0"),
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
        load_requests(path)
    assert str(e.value).startswith(f"{path}:2: ")


def test_missing_or_empty_dataset_says_so(tmp_path):
    with pytest.raises(DatasetError, match="cannot read"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DatasetError, match="no requests"):
        load_prompts(tmp_path / "empty.jsonl")


def test_completion_lines_go_to_the_completions_endpoint_and_a_line_temperature_is_kept(tmp_path):
    path = write(tmp_path, {"prompt": "def f(x):\n", "source": "a.py:3"},
                 {"messages": [{"role": "user", "content": "hi"}], "temperature": 1},
                 {"conversations": [{"from": "human", "value": "yo"}], "temperature": 0.5})
    reqs = load_requests(path)
    assert reqs == [Request(1, prompt="def f(x):\n"),
                    Request(2, messages=[{"role": "user", "content": "hi"}], temperature=1.0),
                    Request(3, messages=[{"role": "user", "content": "yo"}], temperature=0.5)]
    assert [(r.endpoint, r.payload()) for r in reqs[:2]] == [
        ("/v1/completions", {"prompt": "def f(x):\n"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]


@pytest.mark.parametrize("line, why", [({"prompt": "def f():"}, "'prompt' is a completion prompt"),
                                       ({"messages": [{"role": "user", "content": "x"}], "temperature": 1},
                                        "'temperature' of its own")])
def test_chat_only_callers_refuse_what_they_would_send_wrong(tmp_path, line, why):
    """load_prompts' callers (benchmarks, the soak) send every prompt as a chat at one temperature: a completion
    line or a line's own temperature would be sent wrong, so it is refused with the line named."""
    path = write(tmp_path, {"messages": [{"role": "user", "content": "fine"}]}, line)
    with pytest.raises(DatasetError, match=why) as e:
        load_prompts(path)
    assert str(e.value).startswith(f"{path}:2: ")


def test_realcode_is_completion_prompts_the_chat_callers_refuse():
    reqs = load_requests(PROMPTS / "realcode.jsonl")
    assert len(reqs) >= 50 and all(r.prompt and r.endpoint == "/v1/completions" and r.temperature is None
                                   for r in reqs)


def test_mixed_alternates_greedy_code_and_prose_at_temperature_1_as_make_mixed_writes_it():
    path = PROMPTS / "mixed.jsonl"
    assert path.read_text() == make_mixed.render(make_mixed.build()), \
        "mixed.jsonl is stale: python -m loadtest.make_mixed rewrites it from mix.jsonl and prose.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["category"], r["temperature"]) for r in rows[:4]] == [("code", 0), ("prose", 1), ("code", 0),
                                                                       ("prose", 1)]
    assert Counter(r["category"] for r in rows) == {"code": 32, "prose": 32}
    assert {r.temperature for r in load_requests(path)} == {0.0, 1.0}


def test_chat_is_256_token_sampled_chats_as_make_chat_writes_it():
    """The chat workload's prompts are ~256 tokens under the served pair's tokenizer (the chat template applied,
    as the server applies it), each different, sampled at temperature 1."""
    from transformers import AutoTokenizer

    path = PROMPTS / "chat.jsonl"
    assert path.read_text() == make_chat.render(make_chat.build()), \
        "chat.jsonl is stale: python -m loadtest.make_chat rewrites it"
    reqs = load_requests(path)
    tok = AutoTokenizer.from_pretrained(str(make_chat.TOKENIZER))
    lengths = [len(tok(tok.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]) for r in reqs]
    assert len(reqs) == 64 and all(230 <= n <= 282 for n in lengths), lengths
    assert len({json.dumps(r.messages) for r in reqs}) == len(reqs)
    assert {r.temperature for r in reqs} == {1.0} and all(r.messages[0]["role"] == "system" for r in reqs)


def _prompt_tokens(reqs) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(make_chat.TOKENIZER))
    return [len(tok(tok.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False)["input_ids"]) for r in reqs]


def test_chat_service_traffic_is_what_make_traffic_writes():
    for name, rows in make_traffic.build().items():
        assert (PROMPTS / name).read_text() == make_mixed.render(rows), \
            f"{name} is stale: python -m loadtest.make_traffic rewrites it"


def test_multiturn_conversations_share_one_system_prompt_and_grow_turn_by_turn():
    rows = [json.loads(x) for x in (PROMPTS / "multiturn.jsonl").read_text().splitlines()]
    reqs = load_requests(PROMPTS / "multiturn.jsonl")
    assert {r.messages[0]["content"] for r in reqs} == {make_traffic.SYSTEM}     # prefix-cache hits everywhere
    by_conv: dict[int, list] = {}
    for row, r in zip(rows, reqs):
        by_conv.setdefault(row["conversation"], []).append(r.messages)
    assert len(by_conv) == 32 and {len(v) for v in by_conv.values()} == {1, 2, 3, 4}
    for turns in by_conv.values():
        for earlier, later in zip(turns, turns[1:]):
            assert later[:len(earlier)] == earlier and later[-1]["role"] == "user"   # the whole conversation so far
    lengths = _prompt_tokens(reqs)
    assert min(lengths) > 600 and max(lengths) < 1200


def test_long_and_length_mix_prompts_and_answers():
    long = _prompt_tokens(load_requests(PROMPTS / "long.jsonl"))
    assert len(long) == 24 and min(long) > 1200 and max(long) < 2500      # room for answers in a 4k context
    mix = load_requests(PROMPTS / "lengthmix.jsonl")
    lengths = _prompt_tokens(mix)
    assert sum(n < 100 for n in lengths) > len(mix) / 2 and sum(n > 1200 for n in lengths) >= 3
    assert {r.max_tokens for r in mix} == {32, 128, 256}


def test_a_line_max_tokens_is_kept_and_checked(tmp_path):
    (r,) = load_requests(write(tmp_path, {"prompt": "x", "max_tokens": 7}))
    assert r.max_tokens == 7 and load_requests(write(tmp_path, {"prompt": "x"}))[0].max_tokens is None
    for bad in (0, 1.5, "8", True):
        with pytest.raises(DatasetError, match="'max_tokens' must be an integer >= 1"):
            load_requests(write(tmp_path, {"prompt": "x", "max_tokens": bad}))
