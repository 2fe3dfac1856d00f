"""Every config mistake fails before SGLang starts, with one line naming the field."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service.config import ConfigError, load_config
from service.launcher import plan
from service.preflight import check
from tests.conftest import REPO


@pytest.fixture
def tiny_pair(random_pair):
    """These checks are about config plumbing: the random pair's known shapes (4 layers, hidden 256)."""
    return random_pair


def write(tmp_path: Path, data, name="cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def good(pair, **spec) -> dict:
    return {"model": {"path": str(pair["target"])},
            "speculative": spec or {"algorithm": "dflash", "draft_model_path": str(pair["drafter"])}}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_default_cpu_config_passes_preflight():
    cfg = load_config(REPO / "deploy/configs/cpu.yaml")
    report = check(cfg) if cfg.model.path.exists() else None
    if report is None:
        pytest.skip(f"{cfg.model.path} missing (the bundled pair is in the repository; the random one is built by "
                    "scripts/install-cpu.sh)")
    assert report.block_size == report.draft_block_size == 16


def test_tree_config_is_the_default_with_tree_verification_and_passes_preflight():
    """deploy/configs/cpu-tree.yaml serves what cpu.yaml serves, with dflash_adaptive and tree widths among its
    candidates."""
    tree = yaml.safe_load((REPO / "deploy/configs/cpu-tree.yaml").read_text())
    default = yaml.safe_load((REPO / "deploy/configs/cpu.yaml").read_text())
    assert {k: v for k, v in tree.items() if k != "speculative"} == {k: v for k, v in default.items()
                                                                      if k != "speculative"}
    cfg = load_config(REPO / "deploy/configs/cpu-tree.yaml")
    assert cfg.speculative.algorithm == "dflash_adaptive"
    assert cfg.speculative.adaptive_settings().controller.tree_widths(16)
    if cfg.model.path.exists():
        assert check(cfg).draft_block_size == 16


@pytest.mark.parametrize("content, message", [
    (None, "config file not found"),
    ("model: [unclosed", "invalid YAML at line 1"),
    ({"model": {"path": "x"}, "servr": {}}, "servr: unknown key"),
    ({"model": {"path": "x", "dtyp": "float32"}}, "model.dtyp: unknown key"),
    ({"model": {"path": "x"}, "server": {"port": "eighty"}}, "server.port: Input should be a valid integer"),
    ({"model": {"path": "x"}, "server": {"port": 70000}}, "server.port: Input should be less than or equal to 65535"),
    ({"model": {"path": "x"}, "server": {"device": "tpu"}}, "server.device: Input should be 'cpu' or 'cuda'"),
    ({"server": {}}, "model: required field is missing"),
    ({"model": {"path": "x"}, "speculative": {"algorithm": "dflash"}}, "draft_model_path is required"),
    ({"model": {"path": "x"}, "speculative": {"algorithm": "eagle"}}, "speculative.algorithm: Input should be"),
    ("- just\n- a list\n", "(top level): expected a mapping"),
])
def test_config_errors_name_the_field(tmp_path, content, message):
    path = tmp_path / "missing.yaml" if content is None else write(tmp_path, content)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert message in str(e.value)


def test_missing_model_directory(tmp_path):
    cfg = load_config(write(tmp_path, {"model": {"path": "nowhere"}}))
    with pytest.raises(ConfigError, match=r"model.path: directory not found: .*nowhere"):
        check(cfg)


def test_relative_paths_resolve_against_the_config_file(tmp_path, tiny_pair):
    (tmp_path / "sub").mkdir()
    shutil.copytree(tiny_pair["target"], tmp_path / "t")
    cfg = load_config(write(tmp_path / "sub", {"model": {"path": "../t"}}))
    assert cfg.model.path == (tmp_path / "t").resolve()
    assert check(cfg).target_layers == 4


def _edit_drafter(tmp_path, pair, edit) -> Path:
    d = tmp_path / "drafter"
    shutil.copytree(pair["drafter"], d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(hidden_size=512), "drafter hidden_size 512 does not match the target's 256"),
    (lambda c: c.update(vocab_size=5000), "drafter vocab_size 5000 does not match the target's 4096"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 7]), "target_layer_ids [7] out of range"),
    (lambda c: c["dflash_config"].update(mask_token_id=99999), "mask_token_id 99999 is outside the target vocabulary"),
    (lambda c: c.pop("block_size"), "needs an integer block_size"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[0, 1, 2]), "fc.weight has shape [256, 512], expected [256, 768]"),
])
def test_drafter_that_does_not_fit(tmp_path, tiny_pair, edit, message):
    drafter = _edit_drafter(tmp_path, tiny_pair, edit)
    cfg = load_config(write(tmp_path, good(tiny_pair, algorithm="dflash", draft_model_path=str(drafter))))
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert message in str(e.value) and str(e.value).startswith("speculative.draft_model_path:")


def test_block_size_larger_than_trained(tmp_path, tiny_pair):
    data = good(tiny_pair)
    data["speculative"]["block_size"] = 32
    with pytest.raises(ConfigError, match=r"speculative.block_size: 32 is larger than the drafter's trained block_size 16"):
        check(load_config(write(tmp_path, data)))


def test_trees_with_a_kv_page_size_above_1_are_refused_on_cpu_too(tmp_path, tiny_pair):
    """The tree commit remaps the walked path's slots one by one: a paged KV pool cannot hold it on any device."""
    data = good(tiny_pair, algorithm="dflash_adaptive", draft_model_path=str(tiny_pair["drafter"]))
    data["speculative"]["adaptive"] = {"candidates": [1, 16, 64]}
    data["sglang_args"] = {"page_size": 16}
    with pytest.raises(ConfigError, match=r"^speculative.adaptive.candidates: widths \[64\] are above the drafter's "
                                          r"block 16, so they verify a DDTree, which needs KV page size 1, not 16: "
                                          r"unset sglang_args.page_size; use widths up to 16"):
        check(load_config(write(tmp_path, data)))
    data["speculative"]["adaptive"] = {"candidates": [1, 16]}  # chains only: a paged pool serves them
    assert check(load_config(write(tmp_path, data))).draft_block_size == 16


def test_a_tree_width_the_window_cannot_hold_or_a_gpu_that_cannot_read_its_mask_is_refused(tmp_path, tiny_pair,
                                                                                             monkeypatch):
    data = good(tiny_pair, algorithm="dflash_adaptive", draft_model_path=str(tiny_pair["drafter"]))
    data["speculative"]["adaptive"] = {"candidates": [1, 16, 65]}
    with pytest.raises(ConfigError, match=r"^speculative.adaptive.candidates: \[65\] exceed 64 = 4 x the drafter's "
                                          r"trained block_size 16 \(widths 1..16 verify a chain, 17..64 a tree"):
        check(load_config(write(tmp_path, data)))
    data["speculative"]["adaptive"] = {"candidates": [1, 16, 64]}
    assert check(load_config(write(tmp_path, data))).draft_block_size == 16
    data["server"] = {"device": "cuda"}
    with pytest.raises(ConfigError, match=r"^speculative.adaptive.candidates: widths \[64\] are above the drafter's "
                                          r"block 16, so they verify a DDTree, which has not served on a GPU yet "
                                          r"\(set DFLASH_SERVE_GPU_TREES=1 to run it on device cuda\)"):
        check(load_config(write(tmp_path, data)))
    monkeypatch.setenv("DFLASH_SERVE_GPU_TREES", "1")  # the GPU suite's opt-in
    assert check(load_config(write(tmp_path, data))).draft_block_size == 16  # the worker checks SGLang's backend
    data["sglang_args"] = {"attention_backend": "triton"}
    assert check(load_config(write(tmp_path, data))).draft_block_size == 16
    data["sglang_args"] = {"attention_backend": "fa3"}
    with pytest.raises(ConfigError, match=r"^speculative.adaptive.candidates: widths \[64\] are above the drafter's "
                                          r"block 16, so they verify a DDTree, which on GPU needs an attention backend "
                                          r"that reads the tree's mask \(flashinfer or triton\), not fa3: set "
                                          r"sglang_args.attention_backend to flashinfer or triton"):
        check(load_config(write(tmp_path, data)))
    data["sglang_args"] = {"page_size": 16}
    with pytest.raises(ConfigError, match=r"which needs KV page size 1, not 16: unset sglang_args.page_size"):
        check(load_config(write(tmp_path, data)))
    data["server"] = {}
    data["sglang_args"] = {"tp_size": 2}
    with pytest.raises(ConfigError, match=r"which needs tensor parallel size 1, not 2"):
        check(load_config(write(tmp_path, data)))
    data["sglang_args"] = {}
    data["speculative"]["adaptive"] = {"per_request_widths": True}
    assert check(load_config(write(tmp_path, data))).draft_block_size == 16
    data["server"] = {"device": "cuda"}
    with pytest.raises(ConfigError, match=r"^speculative.adaptive.per_request_widths: runs on CPU only"):
        check(load_config(write(tmp_path, data)))
    data["server"] = {}
    data["speculative"]["adaptive"] = {"per_request_widths": "yes"}
    with pytest.raises(ConfigError, match=r"speculative.adaptive.per_request_widths"):
        check(load_config(write(tmp_path, data)))
    data["speculative"]["adaptive"] = {"tree_budget": 15}  # the shape of speculation is a width now
    with pytest.raises(ConfigError, match=r"speculative.adaptive.tree_budget"):
        load_config(write(tmp_path, data))


def test_api_key_comes_from_the_named_environment_variable(tmp_path, tiny_pair, monkeypatch):
    data = good(tiny_pair, algorithm="none") | {"server": {"api_key_env": "DFLASH_TEST_KEY"}}
    cfg = load_config(write(tmp_path, data))
    monkeypatch.delenv("DFLASH_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match="server.api_key_env: environment variable DFLASH_TEST_KEY is not set"):
        plan(cfg, validate_sglang_args=False)
    monkeypatch.setenv("DFLASH_TEST_KEY", "s3cret")
    p = plan(cfg, validate_sglang_args=False)
    # The key travels by environment to service.server_entry, never on the (world-readable) command line.
    assert p.env["DFLASH_SERVE_SGLANG_API_KEY"] == "s3cret"
    assert not any("s3cret" in a for a in p.argv)


def test_admin_key_comes_from_its_own_variable_and_is_not_the_client_key(tmp_path, tiny_pair, monkeypatch):
    data = good(tiny_pair, algorithm="none") | {"server": {"api_key_env": "DFLASH_TEST_KEY",
                                                           "admin_api_key_env": "DFLASH_TEST_ADMIN_KEY"}}
    cfg = load_config(write(tmp_path, data))
    monkeypatch.setenv("DFLASH_TEST_KEY", "s3cret")
    monkeypatch.setenv("DFLASH_TEST_ADMIN_KEY", "")
    with pytest.raises(ConfigError, match="server.admin_api_key_env: environment variable DFLASH_TEST_ADMIN_KEY is "
                                          "not set or empty"):
        plan(cfg, validate_sglang_args=False)
    monkeypatch.setenv("DFLASH_TEST_ADMIN_KEY", "s3cret")
    with pytest.raises(ConfigError, match=r"server.admin_api_key_env: DFLASH_TEST_ADMIN_KEY holds the same key as "
                                          r"DFLASH_TEST_KEY .*different key"):
        plan(cfg, validate_sglang_args=False)
    monkeypatch.setenv("DFLASH_TEST_ADMIN_KEY", "adm1n")
    p = plan(cfg, validate_sglang_args=False)
    assert p.env["DFLASH_SERVE_SGLANG_ADMIN_API_KEY"] == "adm1n"
    assert not any("adm1n" in a for a in p.argv)
    data["server"]["admin_api_key_env"] = "DFLASH_TEST_KEY"
    with pytest.raises(ConfigError, match="server.admin_api_key_env: names the same variable as api_key_env"):
        load_config(write(tmp_path, data))
    data["server"] = {"admin_api_key_env": "DFLASH_TEST_ADMIN_KEY"}
    data["sglang_args"] = {"admin_api_key": "x"}
    with pytest.raises(ConfigError, match="sglang_args.admin_api_key.*server.admin_api_key_env"):
        plan(load_config(write(tmp_path, data)))


@pytest.mark.parametrize("admin_key", ["-adm1n-key", None])
def test_server_entry_hands_keys_that_start_with_a_dash_to_sglang_intact(monkeypatch, admin_key):
    """A key is any string: one starting with "-" (a random admin key is one 1 time in 64) must reach SGLang's
    parser as the flag's value, not be read as the next option (that stopped a CI fleet at start-up)."""
    import secrets

    import sglang.cli.main

    from service import server_entry
    from service.sglang_args import sglang_parser

    seen = {}
    monkeypatch.setattr(sglang.cli.main, "main", lambda: seen.setdefault("argv", list(sys.argv)) and 0)
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: "-" + "r" * n)
    monkeypatch.setenv("DFLASH_SERVE_SGLANG_API_KEY", "--client-key")
    if admin_key:
        monkeypatch.setenv("DFLASH_SERVE_SGLANG_ADMIN_API_KEY", admin_key)
    else:
        monkeypatch.delenv("DFLASH_SERVE_SGLANG_ADMIN_API_KEY", raising=False)
    monkeypatch.delenv("DFLASH_SERVE_SGLANG_ARGS", raising=False)
    monkeypatch.setattr(sys, "argv", ["server_entry", "serve", "--model-path", "m", "--port", "1"])
    assert server_entry.main() == 0
    argv = seen["argv"]
    assert argv[:2] == ["sglang", "serve"]
    args = sglang_parser().parse_args(argv[2:])
    assert args.api_key == "--client-key"
    assert args.admin_api_key == (admin_key or "-" + "r" * 32)


def test_cpu_launch_plan_sets_the_cpu_layer_and_threads(tmp_path, tiny_pair):
    data = good(tiny_pair) | {"server": {"device": "cpu", "cpu_threads": 3}}
    p = plan(load_config(write(tmp_path, data)), validate_sglang_args=False)
    assert p.env["DFLASH_SERVE_CPU"] == "1" and p.env["OMP_NUM_THREADS"] == "3"
    argv = " ".join(p.argv)
    assert "--speculative-algorithm DFLASH" in argv and "--speculative-num-draft-tokens 16" in argv
    assert "--attention-backend torch_native" in argv and "--host 127.0.0.1" in argv
    # an idle CPU scheduler must not busy-poll the cores the model runs on (100% of a core -> ~1%)
    assert "--sleep-on-idle" in p.argv
    data["sglang_args"] = {"sleep_on_idle": False}
    assert "--sleep-on-idle" not in plan(load_config(write(tmp_path, data)), validate_sglang_args=False).argv


def test_dflash_adaptive_launches_the_plugin_algorithm(tmp_path, tiny_pair):
    data = good(tiny_pair, algorithm="dflash_adaptive", draft_model_path=str(tiny_pair["drafter"]))
    argv = " ".join(plan(load_config(write(tmp_path, data)), validate_sglang_args=False).argv)
    assert "--speculative-algorithm DFLASH_ADAPTIVE" in argv and "--speculative-num-draft-tokens 16" in argv


def test_cli_reports_one_line_and_exit_code_2(tmp_path):
    r = cli("check", "-c", str(write(tmp_path, {"model": {"path": "x"}, "bogus": 1})))
    assert r.returncode == 2
    assert r.stderr.strip() == "dflash-serve: error: bogus: unknown key (check the spelling; see the config reference in docs/CONFIG.md)"


def test_sglang_args_are_checked_against_sglangs_parser(tmp_path, tiny_pair):
    """One CLI run (imports SGLang once): a typo in a passthrough flag fails at load time."""
    data = good(tiny_pair) | {"sglang_args": {"chunked_prefil_size": 512}}
    r = cli("check", "-c", str(write(tmp_path, data)))
    assert r.returncode == 2
    assert "sglang_args.chunked_prefil_size: not an `sglang serve` argument (did you mean 'chunked_prefill_size'?)" in r.stderr


def test_serve_refuses_a_bad_sglang_arg_before_loading_anything(tmp_path, tiny_pair):
    """`serve` leaves the check to the server process (it imports SGLang anyway; service/server_entry.py): the
    same config error, exit status 2, and no model loaded."""
    from harness.server import free_port

    data = good(tiny_pair) | {"sglang_args": {"chunked_prefil_size": 512},
                              "server": {"device": "cpu", "port": free_port()}}
    r = cli("serve", "-c", str(write(tmp_path, data)))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "dflash-serve: error: sglang_args.chunked_prefil_size: not an `sglang serve` argument" in r.stderr
    assert "Load weight begin" not in r.stderr


def test_sglang_args_values_and_owned_flags(tiny_pair, tmp_path):
    from service.launcher import activate_cpu_layer_here
    from service.sglang_args import validate_passthrough

    activate_cpu_layer_here()
    cases = [
        ({"chunked_prefill_size": "lots"}, "sglang_args.chunked_prefill_size: invalid value 'lots'"),
        ({"cuda_graph_backend_decode": "sometimes"}, "sglang_args.cuda_graph_backend_decode: invalid value"),
        ({"disable_overlap_schedule": "yes"}, "is an on/off flag"),
        ({"port": 1234}, "sglang_args.port: set this through `server.port`"),
    ]
    for args, message in cases:
        cfg = load_config(write(tmp_path, good(tiny_pair) | {"sglang_args": args}))
        with pytest.raises(ConfigError) as e:
            validate_passthrough(cfg.sglang_args)
        assert message in str(e.value)
    ok = load_config(write(tmp_path, good(tiny_pair) | {"sglang_args": {"chunked_prefill_size": 512, "log_requests": True}}))
    validate_passthrough(ok.sglang_args)


def test_serve_refuses_a_port_in_use(tmp_path, tiny_pair):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        data = good(tiny_pair, algorithm="none") | {"server": {"port": port}}
        r = cli("serve", "-c", str(write(tmp_path, data)))
    assert r.returncode == 2
    assert f"dflash-serve: error: server.port: 127.0.0.1:{port} is already in use" in r.stderr


def test_watermarking_with_dflash_is_refused_naming_the_field(tmp_path, tiny_pair):
    """DFlash's verify never applies SGLang's watermark: a watermarked server would silently serve unmarked text."""
    data = good(tiny_pair)
    data["sglang_args"] = {"enable_watermark": True}
    with pytest.raises(ConfigError, match=r"^sglang_args.enable_watermark: DFlash's verify does not apply"):
        check(load_config(write(tmp_path, data)))
    data["speculative"] = {"algorithm": "none"}
    check(load_config(write(tmp_path, data)))  # plain decoding watermarks as SGLang does


@pytest.mark.parametrize("algorithm", ["none", "dflash"])
def test_more_than_one_tokenizer_worker_is_refused_naming_the_field(tmp_path, tiny_pair, algorithm):
    """SGLang checks no API key with more than one tokenizer worker: every route would be open."""
    data = good(tiny_pair) if algorithm == "dflash" else good(tiny_pair, algorithm="none")
    data["sglang_args"] = {"tokenizer_worker_num": 2}
    r = cli("check", "-c", str(write(tmp_path, data)), "--skip-sglang-args")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("dflash-serve: error: sglang_args.tokenizer_worker_num: 2 tokenizer workers are "
                               "refused: SGLang checks no API key"), r.stderr
    data["sglang_args"] = {"tokenizer_worker_num": 1}
    check(load_config(write(tmp_path, data)))


def _target_with_generation_config(tmp_path: Path, pair, **generation) -> Path:
    """A copy of the pair's target (its files linked) whose generation_config.json sets `generation`."""
    target = tmp_path / "target"
    target.mkdir()
    for f in pair["target"].iterdir():
        if f.name != "generation_config.json":
            (target / f.name).symlink_to(f.resolve())
    (target / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, **generation}))
    return target


def test_a_model_default_dflash_cannot_serve_losslessly_is_refused_at_start_up(tmp_path, tiny_pair):
    """SGLang applies the model's generation_config to every chat request (`sampling_defaults: model`): a repetition
    penalty there, under the overlap scheduler (GPU), would get every chat request refused or served lossy."""
    data = good(tiny_pair) | {"server": {"device": "cuda"}}
    data["model"]["path"] = str(_target_with_generation_config(tmp_path, tiny_pair, repetition_penalty=1.05))
    with pytest.raises(ConfigError, match=r"^model.path: its generation_config.json sets repetition_penalty 1.05 .*"
                                          r"overlap scheduler.*sglang_args.disable_overlap_schedule: true.*"
                                          r"sglang_args.sampling_defaults: openai"):
        check(load_config(write(tmp_path, data)))
    for fix in ({"disable_overlap_schedule": True}, {"sampling_defaults": "openai"}):
        check(load_config(write(tmp_path, data | {"sglang_args": fix})))
    check(load_config(write(tmp_path, data | {"speculative": {"algorithm": "none"}})))  # plain decoding serves it
    check(load_config(write(tmp_path, data | {"server": {"device": "cpu"}})))  # no overlap scheduler on CPU


def test_an_operator_default_dflash_cannot_serve_losslessly_is_refused_at_start_up(tmp_path, tiny_pair):
    data = good(tiny_pair) | {"sglang_args": {"preferred_sampling_params": '{"sampling_seed": 7}'}}
    with pytest.raises(ConfigError, match=r"^sglang_args.preferred_sampling_params: sets sampling_seed 7 .*"
                                          r"remove it from sglang_args.preferred_sampling_params"):
        check(load_config(write(tmp_path, data)))
    data["sglang_args"]["preferred_sampling_params"] = '{"sampling_seed": 7, "temperature": 0}'  # greedy: no coins
    check(load_config(write(tmp_path, data)))
    data["sglang_args"]["preferred_sampling_params"] = "{not json"
    with pytest.raises(ConfigError, match=r"^sglang_args.preferred_sampling_params: not a JSON object"):
        check(load_config(write(tmp_path, data)))
