"""The memory plan `dflash-serve check` prints for a GPU config, computed on CPU with the GPU's size given: a
Qwen3-8B-shaped target and a z-lab-b16-shaped drafter (config.json only, or safetensors headers) on an H100-80GB and
an H200."""
from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import pytest
import yaml

from dflash_models.tiny import drafter_config
from service import cli, memory_plan
from service.memory_plan import GIB, MIB, Shape

# Qwen3-8B's published config.json, less what does not size its memory
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "max_position_embeddings": 40960, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645}
DRAFTER = drafter_config(QWEN3_8B, num_layers=5, block_size=16, target_layer_ids=[1, 9, 17, 25, 33],
                         mask_token_id=151669)
QWEN3_8B_PARAMS = 8_190_735_360  # as published
ADAPTIVE_WIDTHS = [1, 2, 4, 8, 16]


def write_model(directory: Path, config: dict, tensors: dict[str, list[int]] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if tensors is not None:  # the header alone: the plan and the preflight read nothing else
        header = json.dumps({name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}
                             for name, shape in tensors.items()}).encode()
        (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return directory


def drafter_tensors(cfg: dict) -> dict[str, list[int]]:
    h, i, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"] * cfg["head_dim"]
    out = {"fc.weight": [h, len(cfg["dflash_config"]["target_layer_ids"]) * h], "hidden_norm.weight": [h],
           "norm.weight": [h]}
    for n in range(cfg["num_hidden_layers"]):
        p = f"layers.{n}."
        out |= {p + "self_attn.q_proj.weight": [cfg["num_attention_heads"] * cfg["head_dim"], h],
                p + "self_attn.k_proj.weight": [kv, h], p + "self_attn.v_proj.weight": [kv, h],
                p + "self_attn.o_proj.weight": [h, cfg["num_attention_heads"] * cfg["head_dim"]],
                p + "mlp.gate_proj.weight": [i, h], p + "mlp.up_proj.weight": [i, h], p + "mlp.down_proj.weight": [h, i],
                p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
                p + "self_attn.q_norm.weight": [cfg["head_dim"]], p + "self_attn.k_norm.weight": [cfg["head_dim"]]}
    return out


@pytest.fixture
def pair(tmp_path) -> dict[str, Path]:
    return {"target": write_model(tmp_path / "Qwen" / "Qwen3-8B", QWEN3_8B),
            "drafter": write_model(tmp_path / "z-lab" / "Qwen3-8B-DFlash-b16", DRAFTER)}


def plan_for(pair, gib: float, **kw) -> memory_plan.MemoryPlan:
    args = {"gpu_bytes": int(gib * GIB), "gpu_source": "given", "dtype": "bfloat16", "widths": ADAPTIVE_WIDTHS,
            "startup_width": 16, "sglang_args": {"mem_fraction_static": 0.85}, "post_capture": True} | kw
    return memory_plan.plan(pair["target"], QWEN3_8B, pair["drafter"], DRAFTER, **args)


def test_shapes_count_what_the_published_models_hold():
    assert Shape.of(QWEN3_8B).params() == QWEN3_8B_PARAMS
    assert Shape.of(QWEN3_8B).kv_bytes_per_token(2) == 36 * 8 * 128 * 2 * 2 == 147_456
    drafter = Shape.of(DRAFTER)
    assert drafter.kv_bytes_per_token(2) == 5 * 8 * 128 * 2 * 2
    # the drafter has no embedding or LM head of its own (it runs the target's)
    assert drafter.params() == sum(_numel(s) for s in drafter_tensors(DRAFTER).values())
    assert Shape.of(QWEN3_8B).kv_bytes_per_token(2, tp_size=4) == 147_456 // 4
    assert Shape.of(QWEN3_8B).kv_bytes_per_token(2, tp_size=16) == 147_456 // 8  # 8 KV heads: replicated past 8


def _numel(shape: list[int]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


@pytest.mark.parametrize("gib", [80, 141])
def test_the_plan_of_qwen3_8b_on_one_gpu(pair, gib):
    p = plan_for(pair, gib)
    assert p.target_weights == QWEN3_8B_PARAMS * 2 and p.target_source == "estimate from config.json"
    assert p.kv_bytes_per_token == 147_456 + 20_480
    assert p.static_budget == int(gib * GIB * 0.85)
    # post-capture KV sizing: the pool is what the static budget leaves after weights and verify graphs
    assert p.kv_pool_bytes == p.static_budget - p.target_weights - p.drafter_weights - p.graph_bytes
    assert p.kv_tokens == p.kv_pool_bytes // p.kv_bytes_per_token
    assert [g.width for g in p.per_width] == ADAPTIVE_WIDTHS and p.max_bs == 256
    # SGLang's float32 logits buffer for 256 requests x 16 rows is part of the shared graph memory
    assert p.shared_graph_bytes > 256 * 16 * 151936 * 4
    assert p.contexts() == [40960, 32768, 8192, 4096]
    assert p.concurrency(40960) == p.kv_tokens // (40960 + 16)
    text = "\n".join(p.lines())
    assert f"per GPU of {gib:.1f} GiB (given)" in text and "not measured on a GPU" in text
    assert "verify CUDA graphs (estimate)" in text and "taken from the KV pool" in text
    assert f"{p.concurrency(40960):,} at 40,960 (the model's context)" in text


def test_an_h200_holds_more_than_twice_the_context_of_an_h100(pair):
    h100, h200 = plan_for(pair, 80), plan_for(pair, 141)
    assert h200.kv_tokens > 2 * h100.kv_tokens
    assert (h100.concurrency(40960), h200.concurrency(40960)) == (7, 15)
    assert (h100.concurrency(8192), h200.concurrency(8192)) == (37, 77)


def test_without_post_capture_sizing_the_graphs_come_out_of_the_headroom(pair):
    on, off = plan_for(pair, 80), plan_for(pair, 80, post_capture=False)
    assert off.kv_pool_bytes == on.kv_pool_bytes + on.graph_bytes
    assert "taken from the 12.0 GiB headroom" in "\n".join(off.lines())
    tight = plan_for(pair, 80, post_capture=False, sglang_args={"mem_fraction_static": 0.99})
    assert "warning: the verify graphs" in "\n".join(tight.lines())


def test_extra_widths_pay_their_own_flashinfer_workspace(pair):
    plain = plan_for(pair, 80)
    flashinfer = plan_for(pair, 80, sglang_args={"mem_fraction_static": 0.85, "attention_backend": "flashinfer"})
    extra = [b.bytes - a.bytes for a, b in zip(plain.per_width, flashinfer.per_width)]
    assert extra == [memory_plan.FLASHINFER_WORKSPACE] * 4 + [0]  # the start-up width keeps the start-up backend


def test_weights_come_from_safetensors_headers_when_there(tmp_path):
    drafter = write_model(tmp_path / "drafter", DRAFTER, drafter_tensors(DRAFTER))
    target = write_model(tmp_path / "target", QWEN3_8B)
    p = plan_for({"target": target, "drafter": drafter}, 80)
    assert p.drafter_source == "safetensors headers"
    assert p.drafter_weights == 2 * Shape.of(DRAFTER).params()


def test_a_gpu_too_small_names_the_fix(pair):
    text = "\n".join(plan_for(pair, 24, sglang_args={"mem_fraction_static": 0.7}).lines())
    assert "KV pool: nothing left" in text and "sglang_args.mem_fraction_static" in text


def test_sglang_args_and_server_limits_shape_the_plan(pair):
    p = plan_for(pair, 80, sglang_args={"mem_fraction_static": 0.85, "kv_cache_dtype": "fp8_e4m3",
                                        "cuda_graph_max_bs_decode": 64, "tp_size": 2},
                 max_total_tokens=100_000, context=8192)
    assert p.kv_bytes_per_token == (147_456 + 20_480) // 2 // 2  # fp8, and half the KV heads on each of 2 ranks
    assert p.target_weights == QWEN3_8B_PARAMS  # half of the bf16 weights on each rank
    assert p.max_bs == 64 and p.kv_tokens == 100_000 and p.contexts() == [8192, 4096]
    assert plan_for(pair, 80, max_running_requests=32).max_bs == 32  # SGLang caps its default so


def test_sglang_default_mem_fraction():
    """SGLang's own default when the config sets none (its _handle_gpu_memory_settings): a small reserve when it
    sizes the KV pool after capture, at least 10 GiB on a large GPU otherwise."""
    assert memory_plan.sglang_mem_fraction(80 * GIB, post_capture=True) == round((81920 - 1664) / 81920, 3)
    # 512 MiB + 8192 prefill tokens x 1.5 + 1/8 GiB + 256 graphs' batches x 2
    assert memory_plan.sglang_mem_fraction(80 * GIB, post_capture=False) == round((81920 - 13440) / 81920, 3)
    assert memory_plan.sglang_mem_fraction(40 * GIB, post_capture=False, max_bs=32, chunked_prefill=4096) == \
        round((40960 - (512 + 6144 + 128 + 64)) / 40960, 3)
    assert memory_plan.sglang_max_bs(80 * GIB) == memory_plan.sglang_max_bs(141 * GIB) == 256


def test_gpu_memory_is_read_from_nvidia_smi():
    def run(argv, **_):
        assert argv[0] == "nvidia-smi"
        return subprocess.CompletedProcess(argv, 0, stdout="143771\n81559\n", stderr="")

    assert memory_plan.detect_gpu_bytes(run) == (81559 * MIB, "nvidia-smi, the smallest of 2 GPUs")
    assert memory_plan.detect_gpu_bytes(lambda argv, **_: subprocess.CompletedProcess(argv, 9, "", "")) is None


def test_check_prints_the_plan_of_a_gpu_config(pair, tmp_path, capsys, monkeypatch):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (pair["target"] / name).write_text("{}")
    write_model(pair["drafter"], DRAFTER, drafter_tensors(DRAFTER))
    config = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy/configs/gpu-qwen3-8b.yaml").read_text())
    config["model"]["path"] = str(pair["target"])
    config["speculative"]["draft_model_path"] = str(pair["drafter"])
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("DFLASH_SERVE_API_KEY", "k")
    monkeypatch.delenv("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING", raising=False)
    assert cli.main(["check", "-c", str(path), "--skip-sglang-args", "--gpu-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "per GPU of 80.0 GiB (--gpu-memory-gib)" in out
    assert "mem_fraction_static 0.85 (sglang_args.mem_fraction_static)" in out
    assert "taken from the KV pool (post-capture KV sizing)" in out  # the launcher turns it on for dflash_adaptive
    assert "drafter weights 2.0 GiB (safetensors headers)" in out


def test_check_without_a_gpu_says_how_to_give_its_size(pair, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(memory_plan, "detect_gpu_bytes", lambda: None)
    test_config = {"model": {"path": str(pair["target"])}, "server": {"device": "cuda"}}
    (pair["target"] / "tokenizer.json").write_text("{}")
    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump(test_config))
    assert cli.main(["check", "-c", str(path), "--skip-sglang-args"]) == 0
    assert "pass --gpu-memory-gib" in capsys.readouterr().out


@pytest.mark.parametrize("gib", [80, 141])
def test_deployment_doc_quotes_the_plan(pair, gib):
    """docs/DEPLOYMENT.md's sizing table is this function's output for the GPU config's settings."""
    p = plan_for(pair, gib)
    g = memory_plan._gib
    row = (f"| {gib} GiB ", f"| {g(p.target_weights)[:-4]} + {g(p.drafter_weights)} | {g(p.graph_bytes)} | "
           f"{g(p.kv_pool_bytes)}, {p.kv_tokens:,} tokens | "
           + " / ".join(str(p.concurrency(c)) for c in (40960, 32768, 8192, 4096)) + " |")
    doc = (Path(__file__).resolve().parents[2] / "docs" / "DEPLOYMENT.md").read_text()
    line = next(x for x in doc.splitlines() if x.startswith(row[0]))
    assert line.endswith(row[1]), (line, row)
    config = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy/configs/gpu-qwen3-8b.yaml").read_text())
    assert config["sglang_args"]["mem_fraction_static"] == 0.85 and "adaptive" not in config["speculative"]
