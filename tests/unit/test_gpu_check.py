"""The GPU check (scripts/gpu-check/) is ready to run on a CUDA machine: the configs it serves pass the product's
config loading and SGLang's own parser; its start-up hook is inert without its variable and its test-only mode
applies only under it; the offline staging's `--torch-kernels` manifest covers what the serving path imports beyond
torch and Triton, one version each, and a wheel the GPU machine already has is left out; run.sh --dry-run writes a
well-formed report in which a failing check and one that outlives its timeout are recorded, not fatal."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, child_result

KIT = REPO / "scripts" / "gpu-check"
sys.path.insert(0, str(KIT))

import checks  # noqa: E402
import check_hook  # noqa: E402
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


PROVIDED = {"torch", "triton"}  # the GPU machine's own CUDA build, never staged


def test_torch_kernels_manifest_covers_every_distribution_the_serving_path_imports_beyond_torch():
    """What SGLang's HTTP server, scheduler, DFlash worker and our plugin import at module level here (the CPU
    install, pinned by constraints-cpu.txt), torch and Triton aside, must be staged for --torch-kernels."""
    imported = child_result("-c", IMPORTED_DISTRIBUTIONS, *SERVING_PATH)
    pins = _cpu_pins()
    needed = {stage.canonical(d) for d in imported} & set(pins) - PROVIDED
    staged = {stage.canonical(p.name) for p in stage.read_manifest()}
    assert needed, "the probe found no distribution: it did not import the serving path"
    assert sorted(needed - staged) == []
    assert {"sglang", "transformers", "hatchling"} <= staged and not staged & PROVIDED


def test_manifest_is_one_version_each_at_the_cpu_pins_unless_an_override_says_why():
    pins = stage.read_manifest()
    names = [stage.canonical(p.name) for p in pins]
    assert len(names) == len(set(names)), "one version of each: two stop the whole install on the GPU machine"
    cpu = _cpu_pins()
    differ = [p.spec for p in pins if stage.canonical(p.name) in cpu and cpu[stage.canonical(p.name)] != p.version
              and not p.note.startswith("override:")]
    assert differ == []


def test_staging_leaves_out_what_the_gpu_machine_has_and_tells_run_sh_how_to_install(tmp_path, monkeypatch):
    pins = stage.read_manifest()
    have = tmp_path / "freeze.txt"
    have.write_text(f"{pins[0].spec}\n{pins[1].name}==0.0.1\n-e git+https://example.invalid/x#egg=x\n")
    asked = []

    def download(specs, dest, python_version, platforms, resolve):
        asked.append((specs, python_version, resolve))
        for spec in specs:
            name, version = spec.split("==")
            (dest / f"{stage.canonical(name).replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"")

    monkeypatch.setattr(stage, "download", download)
    plan = stage.stage(tmp_path, "3.12", stage.PLATFORMS, stage.read_freeze(have), torch_kernels=True)
    assert asked == [([p.spec for p in pins[1:]], "3.12", False)]
    assert plan["no_deps"] and len(plan["wheels"]) == len(pins) - 1
    assert json.loads((tmp_path / stage.STAGE_FILE).read_text()) == plan


def test_default_staging_resolves_the_gpu_extra_and_the_test_tools():
    reqs = stage.project_requirements()
    assert any(r.startswith("sglang==") for r in reqs) and "pytest>=8" in reqs
    assert any(r.startswith("hatchling") for r in reqs)


def test_every_config_the_check_serves_passes_config_loading_and_sglangs_parser(tmp_path, monkeypatch):
    """A misspelt SGLang flag in a check's config would cost a run on the GPU machine; here it costs seconds."""
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


PROBE_HOOK = r"""
import json, os, sys
sys.path.insert(0, "scripts/gpu-check")
finders = len(sys.meta_path)
import check_hook as hook
exec(hook.HOOK_LINE)  # what site.py runs at every interpreter start while run.sh's hook file is in place
applied = hook.install()
submodules = {}
for name in ("sgl_kernel.quantization", "sgl_kernel.scalar_type"):
    try:
        __import__(name)
        submodules[name] = "stub"
    except ImportError:
        submodules[name] = "missing"
print("RESULT" + json.dumps({"applied": applied, "sgl_kernel": "sgl_kernel" in sys.modules, "submodules": submodules,
                             "finders_added": len(sys.meta_path) - finders,
                             "env": [k for k in hook.UPSTREAM_ENV if k in os.environ]}))
"""
MISSING = {"sgl_kernel.quantization": "missing", "sgl_kernel.scalar_type": "missing"}


@pytest.mark.parametrize("value", [None, "1", "anything"])
def test_the_hook_is_inert_without_its_variable(value):
    env = {} if value is None else {check_hook.VAR: value}
    out = child_result("-c", PROBE_HOOK, cpu_layer=False, **env)
    assert out == {"applied": [], "sgl_kernel": False, "finders_added": 0, "env": [], "submodules": MISSING}


def test_observing_only_logs_and_stands_in_for_no_kernel():
    out = child_result("-c", PROBE_HOOK, cpu_layer=False, **{check_hook.VAR: check_hook.OBSERVE})
    assert out == {"applied": ["jit_log", "replay_log"], "sgl_kernel": False, "finders_added": 1, "env": [],
                   "submodules": MISSING}  # the one finder: when_imported's


def test_the_test_only_mode_applies_under_torch_kernels():
    out = child_result("-c", PROBE_HOOK, cpu_layer=False, **{check_hook.VAR: check_hook.TORCH_KERNELS})
    assert "stub:sgl_kernel" in out["applied"] and out["sgl_kernel"]
    assert out["env"] == list(check_hook.UPSTREAM_ENV)
    # SGLang's CUDA branches import sgl_kernel submodules its CPU path does not (gguf.py: sgl_kernel.quantization);
    # scalar_type stays missing so quantization/utils.py takes its ImportError fallback
    assert out["submodules"] == {"sgl_kernel.quantization": "stub", "sgl_kernel.scalar_type": "missing"}


def test_the_shipped_package_knows_nothing_of_the_check():
    shipped = [REPO / "sglang_ext", REPO / "service"]
    hits = [str(f.relative_to(REPO)) for root in shipped for f in root.rglob("*.py")
            if check_hook.VAR in f.read_text() or "gpu-check" in f.read_text()]
    assert hits == []


def test_run_sh_dry_run_records_a_failing_and_a_timed_out_check_and_reports(tmp_path):
    only = "tiny_plain,tiny_greedy_matches_plain,dry_error,dry_timeout"
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(KIT / "run.sh"), "--dry-run", "--out", str(out), "--time-limit", "120",
                        "--only", only], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr  # a check raised, one timed out
    report = json.loads((out / "report.json").read_text())
    assert report["schema"] == orchestrate.SCHEMA and report["dry_run"] is True
    assert {k: v["status"] for k, v in report["checks"].items()} == {
        "tiny_plain": "pass", "tiny_greedy_matches_plain": "pass", "dry_error": "error", "dry_timeout": "timeout"}
    assert "a check that raises" in report["checks"]["dry_error"]["error"]
    assert report["summary"] == {"pass": 2, "error": 1, "timeout": 1}
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "work"]
    assert (out / "work" / "results" / "dry_error.json").is_file()


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
    a failed nvcc build would run again on every forward."""
    from types import ModuleType

    calls = []

    def load_jit(name, *args, **kwargs):
        calls.append(name)
        raise RuntimeError(f"nvcc failed for {name}")

    jit = ModuleType("fake_jit_utils")
    jit.load_jit = load_jit
    check_hook._log_jit(jit)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="nvcc failed for kvcache"):
            jit.load_jit("kvcache", 256)
    assert calls == ["kvcache"]
    monkeypatch.setenv(check_hook.NO_JIT_VAR, "1")
    with pytest.raises(RuntimeError, match="JIT kernels are off"):
        jit.load_jit("other")
    assert calls == ["kvcache"]


def test_log_facts_read_what_the_server_and_the_mode_log():
    """The report's evidence (graphs captured and replayed per width, JIT builds, fallbacks, stub kernels called,
    the KV pool) is read from the log lines verify_runtimes.py, the start-up hook, the CPU stubs and SGLang write."""
    log = "\n".join([
        "dflash-serve: captured target verify graphs for width 4 in 1.0s",
        "dflash-serve: captured target verify graphs for width 32 (a tree: with its custom mask, batch sizes up to 16)"
        " in 2.0s",
        f"{check_hook.REPLAY_LOG_MARK} 4 (TARGET_VERIFY, batch 1)",
        f"{check_hook.JIT_LOG_MARK} kvcache",
        f"{check_hook.JIT_LOG_MARK} kvcache failed: nvcc exited 1",
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
