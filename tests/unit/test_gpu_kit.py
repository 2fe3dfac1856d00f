"""The GPU kit (scripts/gpu-kit/) is ready for one run on an offline GPU machine: its wheels cover what the serving
path imports that the device image lacks, one version each, in parts that fit a transfer; the configs it serves pass the
product's config loading and SGLang's own parser; its test-only mode is inert without its variable and refused
by the preflight outside the kit; run.sh --dry-run writes a well-formed report in which a failing check and one
that outlives its timeout are recorded, not fatal."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO, child_result

KIT = REPO / "scripts" / "gpu-kit"
sys.path.insert(0, str(KIT))

import checks  # noqa: E402
import gpu_kit_test_only  # noqa: E402
import orchestrate  # noqa: E402
import stage  # noqa: E402

SERVING_PATH = [
    "sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner", "sglang.srt.speculative.dflash_worker_v2",
    "sglang.srt.models.qwen3", "sglang.srt.models.dflash", "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.constrained.xgrammar_backend", "sglang_ext.plugin", "sglang_ext.worker", "service.cli",
    "harness.server", "dflash_models.tiny",
]
IMPORTED_DISTRIBUTIONS = r"""
import importlib, json, sys
from importlib import metadata
for name in sys.argv[1:]:
    importlib.import_module(name)
tops = {m.split(".")[0] for m in list(sys.modules)}
owners = metadata.packages_distributions()
dists = sorted({d for t in tops for d in owners.get(t, [])})
print("RESULT" + json.dumps(dists))
"""


def _cpu_pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements/constraints-cpu.txt").read_text().splitlines():
        spec = line.split("#")[0].strip()
        if "==" in spec:
            name, version = spec.split("==")
            pins[stage.canonical(name)] = version.strip()
    return pins


def _device_image() -> set[str]:
    lines = (KIT / "device-image.txt").read_text().splitlines()
    return {stage.canonical(x) for x in lines if x.strip() and not x.startswith("#")}


def test_manifest_covers_every_distribution_the_serving_path_imports_beyond_the_device_image():
    """What SGLang's HTTP server, scheduler, DFlash worker and our plugin import at module level here (the CPU
    install, pinned by constraints-cpu.txt) and the device image does not have must travel as a wheel."""
    imported = child_result("-c", IMPORTED_DISTRIBUTIONS, *SERVING_PATH)
    pins, image = _cpu_pins(), _device_image()
    needed = {stage.canonical(d) for d in imported} & set(pins) - image
    staged = {stage.canonical(p.name) for p in stage.read_manifest()}
    assert needed, "the probe found no distribution: it did not import the serving path"
    assert sorted(needed - staged) == []
    assert {"sglang", "transformers"} <= staged  # not pinned for CPU / older in the image


def test_manifest_is_one_version_each_at_the_cpu_pins_unless_an_override_says_why():
    pins = stage.read_manifest()
    names = [stage.canonical(p.name) for p in pins]
    assert len(names) == len(set(names)), "one version of each: two stop the whole install on the device"
    cpu = _cpu_pins()
    differ = [p.spec for p in pins if stage.canonical(p.name) in cpu and cpu[stage.canonical(p.name)] != p.version
              and not p.note.startswith("override:")]
    assert differ == []


def test_parts_fit_the_room_a_call_leaves_and_an_oversized_wheel_is_named():
    sizes = {"a": 30, "b": 20, "c": 15, "d": 10, "e": 5}
    parts = stage.split(sizes, room=40)
    assert sorted(n for p in parts for n in p) == sorted(sizes)
    assert all(sum(sizes[n] for n in p) <= 40 for p in parts)
    assert len(parts) == 2
    with pytest.raises(ValueError, match="a .* larger than a transfer's room"):
        stage.split({"a": 41}, room=40)


def test_slimmed_wheel_drops_the_members_and_their_record_lines(tmp_path):
    wheel = tmp_path / "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("sglang/srt/server.py", "x = 1\n")
        z.writestr("sglang/multimodal_gen/big.py", "y = 2\n")
        z.writestr("sglang-0.5.23.dist-info/RECORD",
                   "sglang/srt/server.py,sha256=a,6\nsglang/multimodal_gen/big.py,sha256=b,6\n")
    with zipfile.ZipFile(stage.slim(wheel)) as z:
        assert sorted(z.namelist()) == ["sglang-0.5.23.dist-info/RECORD", "sglang/srt/server.py"]
        assert z.read("sglang-0.5.23.dist-info/RECORD") == b"sglang/srt/server.py,sha256=a,6\n"


def test_every_config_the_kit_serves_passes_config_loading_and_sglangs_parser(tmp_path, monkeypatch):
    """A misspelt SGLang flag in a kit config would cost a whole run on the GPU machine; here it costs seconds."""
    from service.config import parse_config
    from service.preflight import check
    from service.sglang_args import sglang_parser, validate_passthrough

    import models

    monkeypatch.setenv("DFLASH_SERVE_GPU_TREES", "1")
    big = models.build(tmp_path / "big", drafter_weights=False)
    configs = [checks.tiny_config({"algorithm": a}) for a in ("none", "dflash")] + [
        checks.tiny_config({"algorithm": "dflash_adaptive", "adaptive": {"mode": "cycle"}}),
        checks.tiny_config({"algorithm": "dflash_adaptive", "adaptive": {"mode": "cycle",
                                                                         "candidates": checks.TREE_WIDTHS}}),
    ] + [checks.big_config(s, big) for s in ({"algorithm": "none"}, {"algorithm": "dflash"},
                                             {"algorithm": "dflash_adaptive", "adaptive": {"mode": "cycle"}})]
    parser = sglang_parser()
    for cfg in configs:
        config = parse_config(json.loads(json.dumps(cfg, default=str)))
        validate_passthrough(config.sglang_args, parser)
        report = check(config)
        if cfg["speculative"]["algorithm"] != "none":
            assert report.draft_block_size == 16


PROBE_INERT = r"""
import json, os, sys
sys.path.insert(0, "scripts/gpu-kit")
finders = len(sys.meta_path)
import gpu_kit_test_only as mode
exec(mode.HOOK_LINE)  # what site.py runs at every interpreter start once run.sh wrote the hook
applied = mode.install()
submodules = {}
for name in ("sgl_kernel.quantization", "sgl_kernel.scalar_type"):
    try:
        __import__(name)
        submodules[name] = "stub"
    except ImportError:
        submodules[name] = "missing"
print("RESULT" + json.dumps({"applied": applied, "sgl_kernel": "sgl_kernel" in sys.modules, "submodules": submodules,
                             "finders_added": len(sys.meta_path) - finders,
                             "env": [k for k in mode.UPSTREAM_ENV if k in os.environ]}))
"""


def test_test_only_mode_is_inert_without_its_variable():
    out = child_result("-c", PROBE_INERT, cpu_layer=False)
    assert out == {"applied": [], "sgl_kernel": False, "finders_added": 0, "env": [],
                   "submodules": {"sgl_kernel.quantization": "missing", "sgl_kernel.scalar_type": "missing"}}


def test_test_only_mode_applies_with_its_variable():
    out = child_result("-c", PROBE_INERT, cpu_layer=False, DFLASH_SERVE_GPU_KIT_TEST_ONLY="1")
    assert "stub:sgl_kernel" in out["applied"] and out["sgl_kernel"]
    assert out["env"] == list(gpu_kit_test_only.UPSTREAM_ENV)
    # SGLang's CUDA branches import sgl_kernel submodules its CPU path does not (gguf.py: sgl_kernel.quantization);
    # scalar_type stays missing so quantization/utils.py takes its ImportError fallback
    assert out["submodules"] == {"sgl_kernel.quantization": "stub", "sgl_kernel.scalar_type": "missing"}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_preflight_refuses_the_test_only_variable_where_the_kit_hook_did_not_run(device, monkeypatch):
    from service.config import ConfigError, parse_config
    from service.preflight import check

    cfg = checks.tiny_config({"algorithm": "dflash"})
    cfg["server"]["device"] = device
    monkeypatch.setenv("DFLASH_SERVE_GPU_KIT_TEST_ONLY", "1")
    monkeypatch.delitem(sys.modules, "sgl_kernel", raising=False)
    with pytest.raises(ConfigError, match="DFLASH_SERVE_GPU_KIT_TEST_ONLY is set, but it is a test-only mode"):
        check(parse_config(cfg))


def test_run_sh_dry_run_records_a_failing_and_a_timed_out_check_and_reports(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "TMPDIR": str(tmp_path)}
    only = "tiny_plain,tiny_greedy_matches_plain,dry_error,dry_timeout"
    r = subprocess.run(["bash", str(KIT / "run.sh"), "--dry-run", "--budget", "120", "--only", only],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["schema"] == orchestrate.SCHEMA and report["dry_run"] is True
    assert {k: v["status"] for k, v in report["checks"].items()} == {
        "tiny_plain": "pass", "tiny_greedy_matches_plain": "pass", "dry_error": "error", "dry_timeout": "timeout"}
    assert "a check that raises" in report["checks"]["dry_error"]["error"]
    assert report["summary"] == {"pass": 2, "error": 1, "timeout": 1}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["logs.tar.gz", "report.json"]


def test_greedy_comparison_names_the_first_divergence():
    plain = {"status": "pass", "detail": {"output_ids": [[1, 2, 3], [4, 5, 6]]}}
    same = {"status": "pass", "detail": {"output_ids": [[1, 2, 3], [4, 5, 6]]}}
    off = {"status": "pass", "detail": {"output_ids": [[1, 2, 3], [4, 9, 6]]}}
    out = checks.compare_greedy({"tiny_plain": plain, "tiny_dflash": same, "tiny_adaptive_cycle": off})
    assert out["status"] == "fail"
    assert out["detail"]["tiny_dflash"] == {"identical": 2, "of": 2, "first_divergence": []}
    assert out["detail"]["tiny_adaptive_cycle"] == {"identical": 1, "of": 2, "first_divergence": [1]}
    assert out["detail"]["tiny_adaptive_trees"] == "no outputs"


def test_a_failed_jit_build_is_not_retried_on_every_call(monkeypatch):
    """SGLang caches JIT successes only, and store_cache's caller falls back to torch on a failure: unremembered,
    a failed nvcc build would run again on every forward of the device run."""
    from types import ModuleType

    calls = []

    def load_jit(name, *args, **kwargs):
        calls.append(name)
        raise RuntimeError(f"nvcc failed for {name}")

    jit = ModuleType("fake_jit_utils")
    jit.load_jit = load_jit
    gpu_kit_test_only._log_jit(jit)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="nvcc failed for kvcache"):
            jit.load_jit("kvcache", 256)
    assert calls == ["kvcache"]
    monkeypatch.setenv(gpu_kit_test_only.NO_JIT_VAR, "1")
    with pytest.raises(RuntimeError, match="JIT kernels are off"):
        jit.load_jit("other")
    assert calls == ["kvcache"]


def test_log_facts_read_what_the_server_and_the_mode_log():
    """The report's evidence (graphs captured and replayed per width, JIT builds, fallbacks, stub kernels called,
    the KV pool) is read from the log lines verify_runtimes.py, the test-only mode, the CPU stubs and SGLang write."""
    log = "\n".join([
        "dflash-serve: captured target verify graphs for width 4 in 1.0s",
        "dflash-serve: captured target verify graphs for width 32 (a tree: with its custom mask, batch sizes up to 16)"
        " in 2.0s",
        f"{gpu_kit_test_only.REPLAY_LOG_MARK} 4 (TARGET_VERIFY, batch 1)",
        f"{gpu_kit_test_only.JIT_LOG_MARK} kvcache",
        f"{gpu_kit_test_only.JIT_LOG_MARK} kvcache failed: nvcc exited 1",
        "MissingKernelError: sgl_kernel.rmsnorm was called, but it is a GPU kernel with no CPU implementation in "
        "dflash-serve.",
        "KV Cache is allocated. #tokens: 1234",
    ])
    facts = checks.log_facts(log)
    assert facts["captured_verify_widths"] == [4] and facts["captured_tree_widths"] == [32]
    assert facts["replayed_widths"] == [4]
    assert facts["jit_kernels"] == ["kvcache"] and facts["jit_failed"] == ["kvcache failed: nvcc exited 1"]
    assert facts["missing_kernels"] == ["sgl_kernel.rmsnorm"] and facts["kv_pool_tokens"] == [1234]
    assert checks._log_problems(facts) == ["stub kernels were called: ['sgl_kernel.rmsnorm']"]
    assert checks._log_problems(checks.log_facts(checks.FELL_BACK)) == ["a Triton branch fell back to the eager path"]
