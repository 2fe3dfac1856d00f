"""On a CUDA GPU: every target family of the support matrix (docs/MODELS.md) served by `dflash_adaptive` in cycle
mode (every width, switching every step; per-width verify CUDA graphs) emits what plain decoding emits. The tiny
random pairs are built on the machine from transformers' config classes (dflash_models/families.py: no model hub),
served in fp32 with Triton attention (the backend SGLang accepts for every family here, sliding windows and
gpt-oss's sinks included, and one that runs fp32), so greedy outputs compare token for token. Also a DFlash2
drafter under `dflash_adaptive` (the selector's walk in the draft CUDA graph) and the Qwen3.5 hybrid under upstream
`dflash` (and `dflash_adaptive` refused there until it has served on a GPU).
`python3 -m pytest tests/gpu/test_gpu_families.py` on any CUDA GPU; skipped elsewhere (tests/gpu/conftest.py)."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from harness.server import ManagedServer
from tests.conftest import PROMPTS

FAMILIES = ("qwen3", "llama3", "qwen3_moe", "gemma4", "gpt_oss")
MAX_NEW = 24


def _config(pair: dict, speculative: dict) -> dict:
    return {
        "model": {"path": str(pair["target"]), "dtype": "float32", "served_name": "tiny"},
        "server": {"host": "127.0.0.1", "device": "cuda", "metrics": True, "max_running_requests": 16},
        "speculative": speculative,
        "sglang_args": {"attention_backend": "triton", "mem_fraction_static": 0.5},
    }


def _greedy(cfg: dict, workdir: Path, name: str, prompts: list[list[int]]):
    with ManagedServer(cfg, workdir, name) as server:
        single = [server.generate(ids, max_new_tokens=MAX_NEW, temperature=0) for ids in prompts]
        batched = server.generate(prompts, max_new_tokens=MAX_NEW, temperature=0)
        log = server.log_tail(400)
    return [r["output_ids"] for r in single], [r["output_ids"] for r in batched], single, log


@pytest.mark.parametrize("family", FAMILIES)
def test_family_adaptive_cycle_matches_plain_decoding_on_gpu(family):
    from transformers import AutoTokenizer

    from dflash_models import families

    with tempfile.TemporaryDirectory() as tmp:
        pair = families.build(family, Path(tmp) / family)
        tok = AutoTokenizer.from_pretrained(str(pair["target"]))
        prompts = [tok(p)["input_ids"] for p in PROMPTS[:4]]
        base, base_batched, _, _ = _greedy(_config(pair, {"algorithm": "none"}), Path(tmp), f"{family}-plain",
                                           prompts)
        cycle = {"algorithm": "dflash_adaptive", "draft_model_path": str(pair["drafter"]),
                 "adaptive": {"mode": "cycle", "candidates": [1, 2, 4, 8]}}
        spec, spec_batched, single, log = _greedy(_config(pair, cycle), Path(tmp), f"{family}-cycle", prompts)
    assert "captured target verify graphs for width" in log, "per-width verify CUDA graphs were not captured"
    assert spec == base and spec_batched == base_batched == base
    assert max(r["meta_info"]["spec_accept_length"] for r in single) > 1.2


def test_dflash2_drafter_adaptive_cycle_matches_upstream_and_plain_decoding_on_gpu():
    """A DFlash2 drafter (a random DFlash drafter with DFlash2's selector and convolutions added,
    dflash_models/dflash2.py) on the Qwen3 family: the selector's walk runs inside the draft CUDA graph, and its
    path verified at every width of the cycle gives plain decoding's greedy output; sampled requests reach the
    selector's q accept (upstream's Triton rejection kernel) without error."""
    from transformers import AutoTokenizer

    from dflash_models import dflash2, families

    with tempfile.TemporaryDirectory() as tmp:
        pair = families.build("qwen3", Path(tmp) / "qwen3")
        drafter = dflash2.convert(pair["drafter"], Path(tmp) / "dflash2", conv_group_size=16)
        tok = AutoTokenizer.from_pretrained(str(pair["target"]))
        prompts = [tok(p)["input_ids"] for p in PROMPTS[:4]]
        base, base_batched, _, _ = _greedy(_config(pair, {"algorithm": "none"}), Path(tmp), "d2-plain", prompts)
        cycle = {"algorithm": "dflash_adaptive", "draft_model_path": str(drafter),
                 "adaptive": {"mode": "cycle", "candidates": [1, 2, 4, 8]}}
        cfg = _config(pair, cycle)
        with ManagedServer(cfg, Path(tmp), "d2-cycle") as server:
            spec = [server.generate(ids, max_new_tokens=MAX_NEW, temperature=0)["output_ids"] for ids in prompts]
            spec_batched = [r["output_ids"] for r in server.generate(prompts, max_new_tokens=MAX_NEW, temperature=0)]
            sampled = server.generate(prompts * 4, max_new_tokens=MAX_NEW, temperature=1.0)
            log = server.log_tail(600)
    assert "selector decode folded into the draft cuda graph" in log
    assert spec == base and spec_batched == base_batched == base
    assert all(len(r["output_ids"]) == MAX_NEW for r in sampled)


def test_hybrid_target_under_dflash_matches_plain_and_adaptive_is_refused_on_gpu(tmp_path):
    """The Qwen3.5 hybrid (gated delta net + full attention) on a GPU: upstream `dflash` (its mamba verify commit,
    CUDA graphs) gives plain decoding's greedy output, and `dflash_adaptive` is refused by the preflight with the
    reason and the fix until its per-width verify graphs with the recurrent-state buffers have served here."""
    import yaml
    from transformers import AutoTokenizer

    from dflash_models import family_qwen3_5
    from service.config import ConfigError, load_config
    from service.preflight import check

    pair = family_qwen3_5.build(tmp_path / "qwen3_5")
    tok = AutoTokenizer.from_pretrained(str(pair["target"]))
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:4]]

    def hybrid(spec: dict) -> dict:
        cfg = _config(pair, spec)
        cfg["sglang_args"]["max_mamba_cache_size"] = 64
        return cfg

    base, base_batched, _, _ = _greedy(hybrid({"algorithm": "none"}), tmp_path, "hybrid-plain", prompts)
    spec, spec_batched, _, _ = _greedy(hybrid({"algorithm": "dflash", "draft_model_path": str(pair["drafter"])}),
                                       tmp_path, "hybrid-dflash", prompts)
    assert spec == base and spec_batched == base_batched == base
    path = tmp_path / "adaptive.yaml"
    path.write_text(yaml.safe_dump(hybrid({"algorithm": "dflash_adaptive", "draft_model_path": str(pair["drafter"])})))
    with pytest.raises(ConfigError, match=r"hybrid target .* on CPU only.*speculative.algorithm: dflash"):
        check(load_config(path))
