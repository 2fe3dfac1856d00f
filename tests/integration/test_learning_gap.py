"""The gate's original-mix figure holds across a hot swap, through a real server: a candidate drafter (the bundled
one with noise on every weight: it loses on the original mix) is scored by the gate (gate.measure, the replay the
learner runs) against the bundled drafter on held-out stdlib prompts, and served on the same prompts by an upstream
`dflash` server (every step verifies the full block: tokens per verify is the figure the gate replays) before and
after it is hot-swapped in as the learner swaps it. Its loss on the original mix as served must be the gate's within
3 percentage points (docs/BENCHMARKS.md#learning: where the gate's figure and serving's part)."""
from __future__ import annotations

import pytest

from dflash_models.learn import swap
from loadtest import server_metrics
from tests.conftest import default_config

pytestmark = pytest.mark.server

ADMIN, ADMIN_ENV = "admin-key-42-learning-gap", "DFLASH_LEARN_GAP_TEST_ADMIN_KEY"
NEW = 64  # tokens a prompt


def _perturbed(src, out, scale: float):
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(7)
    sd = {k: (v.float() + scale * v.float().std() * torch.randn(v.shape, generator=g)).to(torch.bfloat16)
          for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((src / "config.json").read_text())
    return out


def _served(server, prompts) -> tuple[float, list[list[int]]]:
    """Tokens per verify step on `prompts` (greedy, NEW tokens each; the prefill's first token left out, as the gate
    replays from it) and the outputs."""
    before = server_metrics.scrape(server.url)
    outs = [server.generate(p, max_new_tokens=NEW, temperature=0)["output_ids"] for p in prompts]
    after = server_metrics.scrape(server.url)

    def d(name: str) -> float:
        return (server_metrics.total(after, name) or 0.0) - (server_metrics.total(before, name) or 0.0)

    return (d("sglang:generation_tokens_total") - len(prompts)) / d("sglang:spec_verify_calls_total"), outs


def test_the_gate_original_mix_figure_is_what_serving_gets_after_a_swap(module_server_factory, tiny_pair,
                                                                        tmp_path):
    from dflash_models import corpus, data
    from dflash_models.learn import gate
    from dflash_models.learn.distill import Pair, load_drafter

    cfg = default_config(tiny_pair, algorithm="dflash", draft_model_path=tiny_pair["drafter"])
    cfg["server"]["admin_api_key_env"] = ADMIN_ENV
    server = module_server_factory(cfg, "learning-gap", env={ADMIN_ENV: ADMIN})
    pair = Pair(tiny_pair["target"])
    texts = [p.text for p in data.prompts(corpus.split_files(corpus.stdlib_files()).heldout, 16, 12)]
    prompts = [ids[-192:] for ids in pair.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    static, reference = _served(server, prompts)
    candidate = _perturbed(tiny_pair["drafter"], tmp_path / "candidate", 0.3)
    swap.push(server.url, candidate, "candidate", ADMIN)
    swapped, outs = _served(server, prompts)
    assert outs == reference, "greedy output changed with the drafter"

    base, cfg_d = load_drafter(tiny_pair["drafter"])
    cand, _ = load_drafter(candidate)
    items = pair.items([p + o for p, o in zip(prompts, reference)], [len(p) for p in prompts],
                       list(cfg_d["dflash_config"]["target_layer_ids"]), log=lambda *_: None)
    g_static = gate.measure(base, pair.embed, pair.head_w, items)["all"].tokens_per_step
    g_cand = gate.measure(cand, pair.embed, pair.head_w, items)["all"].tokens_per_step
    gate_change, served_change = g_cand / g_static - 1, swapped / static - 1
    print(f"gate {g_static:.3f} -> {g_cand:.3f}, served {static:.3f} -> {swapped:.3f}")
    assert gate_change < -0.03, f"the candidate should lose on the original mix: gate {gate_change:+.1%}"
    assert abs(served_change - gate_change) <= 0.03, (
        f"original mix: gate {g_static:.3f} -> {g_cand:.3f} ({gate_change:+.1%}), served {static:.3f} -> "
        f"{swapped:.3f} ({served_change:+.1%})")
    # the learner's gate refuses it on that loss, however much it gained on recent traffic
    assert not gate.decide(4.0, 5.0, g_static, g_cand, margin=0.05, max_original_loss=0.03).promote
