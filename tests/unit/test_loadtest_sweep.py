"""The sweep's inputs (named configurations, --url) and outputs (report, CSV, plots) without any server."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from loadtest import report, server_metrics
from loadtest import sweep as sweep_mod
from loadtest.sweep import (DEFAULT_CONFIGS, SweepError, Workload, chosen_workloads, deep_merge, describe_workload,
                            load_configs, main, parse_urls)


def test_shipped_configurations_validate_with_absolute_paths():
    baseline, base, configs, overrides, workloads = load_configs(DEFAULT_CONFIGS)
    assert base == (DEFAULT_CONFIGS.parent.parent / "deploy/configs/cpu.yaml").resolve()
    assert overrides["dflash-b4"] == {"speculative": {"algorithm": "dflash", "block_size": 4}}
    assert baseline == "no-spec"
    assert list(configs) == ["no-spec", "dflash-b4", "dflash-b8", "dflash-b16", "dflash-adaptive",
                             "dflash-adaptive-ragged", "dflash-tree16", "dflash-tree31", "dflash-tree63",
                             "dflash-adaptive-shape"]
    # a tree of N draft prefixes is held at verify width N + 1; the adaptive shape chooses among chains and trees
    for n in (16, 31, 63):
        adaptive = configs[f"dflash-tree{n}"]["speculative"]["adaptive"]
        assert (adaptive["mode"], adaptive["fixed_block"]) == ("fixed", n + 1)
    assert configs["dflash-adaptive-shape"]["speculative"]["adaptive"]["candidates"] == [1, 2, 4, 8, 16, 32, 64]
    assert overrides["dflash-adaptive"] == {"speculative": {"algorithm": "dflash_adaptive", "block_size": None}}
    assert configs["dflash-adaptive-ragged"]["speculative"]["adaptive"]["per_request_widths"] is True
    assert configs["no-spec"]["speculative"]["algorithm"] == "none"
    assert [configs[f"dflash-b{b}"]["speculative"]["block_size"] for b in (4, 8, 16)] == [4, 8, 16]
    for cfg in configs.values():     # written to another directory by ManagedServer: paths must not be relative
        assert Path(cfg["model"]["path"]).is_absolute() and Path(cfg["model"]["path"]).is_dir()


def test_shipped_workloads_are_the_two_ends_and_traffic_the_pair_was_not_tuned_on():
    workloads = load_configs(DEFAULT_CONFIGS).workloads
    prompts = DEFAULT_CONFIGS.parent / "prompts"
    assert workloads == {"code": Workload(prompts / "mix.jsonl", 0.0),
                         "prose": Workload(prompts / "prose.jsonl", 1.0),
                         "realcode": Workload(prompts / "realcode.jsonl", 0.0),
                         "mixed": Workload(prompts / "mixed.jsonl", 0.0),
                         "chat": Workload(prompts / "chat.jsonl", 1.0),
                         "multiturn": Workload(prompts / "multiturn.jsonl", 1.0),
                         "long": Workload(prompts / "long.jsonl", 0.0),
                         "lengthmix": Workload(prompts / "lengthmix.jsonl", 1.0),
                         "code-heavy-client": Workload(prompts / "mix.jsonl", 0.0,
                                                       (DEFAULT_CONFIGS.parent.parent / "models/tiny-code/target"
                                                        ).resolve())}
    assert describe_workload(workloads["realcode"])["endpoints"] == ["/v1/completions"]
    assert describe_workload(workloads["mixed"])["line_temperatures"] == [0.0, 1.0]
    prose = [json.loads(line) for line in workloads["prose"].dataset.read_text().splitlines()]
    assert len(prose) >= 30 and {p["category"] for p in prose} == {"prose"}
    assert not any("def " in m["content"] or "import " in m["content"] for p in prose for m in p["messages"])


def _args(**kw):
    import argparse

    return argparse.Namespace(**{"dataset": None, "temperature": None, "workloads": None,
                                 "config_file": DEFAULT_CONFIGS, **kw})


def test_workload_choice_ad_hoc_or_named():
    shipped = load_configs(DEFAULT_CONFIGS).workloads
    assert list(chosen_workloads(_args(), shipped)) == ["code", "prose", "realcode", "mixed", "chat", "multiturn",
                                                       "long", "lengthmix", "code-heavy-client"]
    assert list(chosen_workloads(_args(workloads=["prose"]), shipped)) == ["prose"]
    assert chosen_workloads(_args(temperature=0.7), shipped) == {"custom": Workload(None, 0.7)}
    with pytest.raises(SweepError, match=r"unknown workload\(s\) \['nope'\]"):
        chosen_workloads(_args(workloads=["nope"]), shipped)
    with pytest.raises(SweepError, match="exclude each other"):
        chosen_workloads(_args(workloads=["code"], temperature=1.0), shipped)


def test_a_bad_workload_is_named(tmp_path):
    base = str(DEFAULT_CONFIGS.parent.parent / "deploy/configs/cpu.yaml")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"base": base, "configs": {"a": {}},
                                                     "workloads": {"w": {"temperature": -1}}}))
    with pytest.raises(SweepError, match=r"workloads\.w\.temperature: expected a number >= 0"):
        load_configs(tmp_path / "c.yaml")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"base": base, "configs": {"a": {}},
                                                     "workloads": {"w": {"dataset": "missing.jsonl"}}}))
    with pytest.raises(SweepError, match=r"workloads\.w\.dataset: .*missing\.jsonl: cannot read"):
        load_configs(tmp_path / "c.yaml")


@pytest.mark.parametrize("workload, why", [
    ({"client_tokenizer": "."}, r"workloads\.w\.client_tokenizer: .* holds no Hugging Face tokenizer"),
    ({"client_tokenizer": 3}, r"workloads\.w\.client_tokenizer: expected a directory path"),
    ({"tokenizer": "x"}, r"workloads\.w\.tokenizer: unknown field; a workload has \{dataset: .*client_tokenizer"),
    ({"dataset": "d.jsonl"}, r"workloads\.w\.dataset: .*d\.jsonl:2: 'temperature' must be a number >= 0"),
])
def test_a_bad_workload_field_is_named(tmp_path, workload, why):
    (tmp_path / "d.jsonl").write_text('{"prompt": "def f():"}\n{"prompt": "x", "temperature": -2}\n')
    base = str(DEFAULT_CONFIGS.parent.parent / "deploy/configs/cpu.yaml")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"base": base, "configs": {"a": {}}, "workloads": {"w": workload}}))
    with pytest.raises(SweepError, match=why):
        load_configs(tmp_path / "c.yaml")


def test_a_configuration_is_one_entry(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "base": str(DEFAULT_CONFIGS.parent.parent / "deploy/configs/cpu.yaml"),
        "configs": {"small-batch": {"server": {"max_running_requests": 4}}}}))
    configs = load_configs(tmp_path / "c.yaml").full
    assert configs["small-batch"]["server"]["max_running_requests"] == 4
    assert configs["small-batch"]["speculative"]["algorithm"] == "dflash_adaptive"  # the rest from the base


def test_a_bad_configuration_fails_before_any_server_starts(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "base": str(DEFAULT_CONFIGS.parent.parent / "deploy/configs/cpu.yaml"),
        "configs": {"typo": {"speculative": {"blok_size": 4}}}}))
    with pytest.raises(SweepError, match=r"configs\.typo: speculative\.blok_size: unknown key"):
        load_configs(tmp_path / "c.yaml")
    assert main(["--config-file", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "o")]) == 2


def test_deep_merge_overrides_nested_keys_and_none_deletes():
    base = {"a": {"x": 1, "y": 2}, "b": 3}
    assert deep_merge(base, {"a": {"y": 5, "x": None}, "c": 4}) == {"a": {"y": 5}, "b": 3, "c": 4}
    assert base == {"a": {"x": 1, "y": 2}, "b": 3}


def test_url_arguments():
    assert parse_urls(["a=http://127.0.0.1:1/", "b=https://h:2"]) == {"a": "http://127.0.0.1:1", "b": "https://h:2"}
    with pytest.raises(SweepError, match="NAME=http"):
        parse_urls(["http://127.0.0.1:1"])


def test_unknown_configuration_is_named(tmp_path, capsys):
    assert main(["--configs", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown configuration(s) ['nope']" in capsys.readouterr().err


METRICS_BEFORE = """\
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{is_streaming="true"} 100
sglang:generation_tokens_total{is_streaming="false"} 10
# TYPE sglang:spec_verify_calls_total counter
sglang:spec_verify_calls_total 50
# TYPE dflash_block_size_steps_total counter
dflash_block_size_steps_total{block_size="16"} 10
dflash_block_size_steps_total{block_size="4"} 0
"""
METRICS_AFTER = """\
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{is_streaming="true"} 400
sglang:generation_tokens_total{is_streaming="false"} 10
# TYPE sglang:spec_verify_calls_total counter
sglang:spec_verify_calls_total 150
# TYPE dflash_block_size_steps_total counter
dflash_block_size_steps_total{block_size="16"} 35
dflash_block_size_steps_total{block_size="4"} 75
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs 0
"""


def test_metric_deltas_acceptance_and_block_size_shares():
    d = server_metrics.point_deltas(server_metrics.parse(METRICS_BEFORE), server_metrics.parse(METRICS_AFTER))
    assert d["generation_tokens"] == 300 and d["spec_verify_calls"] == 100 and d["accept_length"] == 3.0
    assert d["block_size_shares"] == {"4": 0.75, "16": 0.25}       # numeric order
    ragged = METRICS_AFTER + "# TYPE dflash_ragged_steps_total counter\ndflash_ragged_steps_total 20\n"
    d = server_metrics.point_deltas(server_metrics.parse(METRICS_BEFORE), server_metrics.parse(ragged))
    assert d["block_size_shares"] == pytest.approx({"4": 75 / 120, "16": 25 / 120, "ragged": 20 / 120})
    assert list(d["block_size_shares"]) == ["4", "16", "ragged"]  # per-request widths' steps: a share of their own


def test_metric_deltas_tolerate_a_server_without_spec_or_block_metrics():
    plain = server_metrics.parse('# TYPE sglang:generation_tokens_total counter\n'
                                 'sglang:generation_tokens_total 7\n')
    d = server_metrics.point_deltas(plain, plain)
    assert d["accept_length"] is None and d["block_size_shares"] is None
    assert server_metrics.point_deltas(None, None) == {"metrics": False}


def _point(config: str, users: int, tok_s: float, accept: float | None = None) -> dict:
    dist = {"count": 10, "mean": 1.0, "p50": 10.0 * users, "p90": 15.0 * users, "p99": 20.0 * users}
    return {"config": config, "users": users, "ok": True, "requests": 10, "failures": 0, "failure_ratio": 0.0,
            "completed": 10, "output_tok_s": tok_s, "req_s": 1.0, "window": "steady", "ttft": dist, "itl": dist,
            "tpot": dist, "e2e": dist, "output_tokens": {**dist, "mean": 128.0},
            "server": {"accept_length": accept, "block_size_shares": {"8": 1.0} if accept else None}}


def test_report_table_speedup_csv_and_plots(tmp_path):
    points = [_point("no-spec", 1, 50), _point("no-spec", 4, 100), _point("dflash-b16", 1, 150, 3.5),
              _point("dflash-b16", 4, 200, 3.0),
              {"config": "dflash-b16", "users": 8, "ok": False, "error": "locust exited 1: failure ratio"}]
    meta = {"started": "t0", "finished": "t1", "baseline": "no-spec", "duration_s": 20, "warmup": 2,
            "max_tokens": 128, "temperature": 0, "dataset": "bundled mix", "cpu_count": 2,
            "configs": {"no-spec": {"config": {"speculative": {"algorithm": "none"}}}, "dflash-b16": {"url": "x"}}}
    report.write_results(tmp_path, meta, points)
    written = report.write_report(tmp_path)
    names = {p.name for p in written}
    assert {"results.csv", "report.md", "throughput.png", "ttft.png", "itl.png", "speedup.png"} <= names
    assert all((tmp_path / n).stat().st_size > 1000 for n in names if n.endswith(".png"))
    md = (tmp_path / "report.md").read_text()
    assert "| dflash-b16 | 1 | 150.0 | 3.00× | 10 | 20 |" in md
    assert "| dflash-b16 | 4 | 200.0 | 2.00× |" in md
    assert "## Speedup over no-spec" in md and "| 4 | 2.00 |" in md
    assert "| 1 | 0.33 | 3.00 |" in md and "| **worst** | 0.33 | 2.00 |" in md  # each against the best other
    assert "dflash-b16 users 8: locust exited 1" in md                 # failed points are reported, not hidden
    assert "8:100%" in md                                              # block-size shares when the server has them
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert len(rows) == 5 and float(rows[2]["speedup"]) == pytest.approx(3.0)
    assert json.loads((tmp_path / "results.json").read_text())["meta"]["baseline"] == "no-spec"
    assert main(["--report-only", "--out", str(tmp_path)]) == 0          # regenerate from results.json


def test_report_names_the_workloads_endpoints_temperatures_and_client_work(tmp_path):
    heavy = _point("dflash-b16", 2, 80) | {"duration_s": 20.0,
                                           "client_tokenize": {"count": 400, "mean": 2.5, "p50": 2.0, "p99": 6.0}}
    meta = {"started": "t0", "baseline": "no-spec", "duration_s": 20, "warmup": 2, "max_tokens": 128,
            "temperature": 0.0, "dataset": "mixed.jsonl", "cpu_count": 2, "configs": {},
            "endpoints": ["/v1/chat/completions", "/v1/completions"], "line_temperatures": [0.0, 1.0],
            "client_tokenizer": "models/tiny-code/target"}
    md = report.markdown(meta, [heavy], [])
    assert "streaming chat completions and completions (raw prompts, no chat template)" in md
    assert "temperature 0.0 where a prompt carries none (the prompts' own: 0, 1)" in md
    assert "re-tokenizes the text received so far on every streamed chunk with the tokenizer in " \
           "models/tiny-code/target" in md
    assert "| dflash-b16 | 2 | 400 | 2.00 | 6.00 | 2.50 | 0.05 |" in md   # 400 x 2.5 ms over 20 s
    plain = report.markdown({**meta, "endpoints": None, "line_temperatures": [], "client_tokenizer": None},
                            [_point("dflash-b16", 2, 80)], [])
    assert "streaming chat completions)" in plain and "Client work" not in plain and "temperature 0.0," in plain


def test_fleet_configurations_run_as_fleets():
    """loadtest/fleet.yaml: the configurations with a `fleet:` section are the ones the sweep starts as fleets."""
    baseline, _, configs, overrides, workloads = load_configs(DEFAULT_CONFIGS.parent / "fleet.yaml")
    assert baseline == "one-server" and list(workloads) == ["code"]
    fleets = {name: configs[name]["fleet"]["replicas"] for name in configs if "fleet" in overrides[name]}
    assert fleets == {"router-1": 1, "fleet-2": 2}
    # the same server everywhere: only the fleet differs
    assert len({json.dumps(c["speculative"], sort_keys=True) for c in configs.values()}) == 1


def test_a_fleets_metrics_are_its_replicas_summed(monkeypatch):
    """The sweep scrapes each replica of a fleet: totals (and idleness) are the fleet's; a replica that does not
    answer is left out, and a fleet where none answers has no metrics."""
    texts = {"a": "sglang:num_requests_total 3\nsglang:num_running_reqs 0\n",
             "b": "sglang:num_requests_total 4\nsglang:num_running_reqs 2\n"}
    monkeypatch.setattr(server_metrics, "scrape",
                        lambda url, headers=None, timeout=30: server_metrics.parse(texts[url]) if url in texts else None)
    both = server_metrics.scrape_all(["a", "b"])
    assert server_metrics.total(both, "sglang:num_requests_total") == 7
    assert not server_metrics.is_idle(both) and server_metrics.is_idle(server_metrics.scrape_all(["a", "gone"]))
    assert server_metrics.scrape_all(["gone"]) is None


def test_position_acceptance_is_the_fleets_accepted_over_tried_per_position():
    text = ("# TYPE dflash_tried_tokens_by_position_total counter\n"
            'dflash_tried_tokens_by_position_total{{model_name="m",position="1"}} {t1}\n'
            'dflash_tried_tokens_by_position_total{{model_name="m",position="2"}} {t2}\n'
            "# TYPE dflash_accepted_tokens_by_position_total counter\n"
            'dflash_accepted_tokens_by_position_total{{model_name="m",position="1"}} {a1}\n'
            'dflash_accepted_tokens_by_position_total{{model_name="m",position="2"}} {a2}\n')
    before = server_metrics.parse(text.format(t1=10, t2=5, a1=5, a2=1))
    after_a = server_metrics.parse(text.format(t1=110, t2=85, a1=85, a2=41))
    # a second replica, summed as scrape_all sums it
    after = {k: v + server_metrics.parse(text.format(t1=100, t2=0, a1=0, a2=0))[k] for k, v in after_a.items()}
    before2 = {k: v + server_metrics.parse(text.format(t1=0, t2=0, a1=0, a2=0))[k] for k, v in before.items()}
    assert server_metrics.position_acceptance(before2, after) == pytest.approx({"1": 80 / 200, "2": 40 / 80})
    assert server_metrics.point_deltas(before2, after)["position_acceptance"] == pytest.approx(
        {"1": 0.4, "2": 0.5})


def test_behind_a_router_the_sweep_reads_the_replicas(monkeypatch):
    """A --url whose /metrics are SGLang's is read itself; a router's replicas come from --replicas or its
    /workers list, the unreachable ones left out; with neither, the url (and a warning)."""
    sglang = server_metrics.parse("sglang:num_running_reqs 0\n")
    monkeypatch.setattr(server_metrics, "scrape", lambda url, headers=None, timeout=30:
                        sglang if url in ("http://server", "http://r1", "http://r2") else None)
    monkeypatch.setattr(sweep_mod, "router_workers", lambda url, timeout=10:
                        ["http://r1", "http://r2", "http://gone"] if url == "http://router" else [])
    assert sweep_mod.metrics_sources("s", "http://server", {}) == ["http://server"]
    assert sweep_mod.metrics_sources("f", "http://router", {}) == ["http://r1", "http://r2"]
    assert sweep_mod.metrics_sources("f", "http://router", {"f": ["http://x"]}) == ["http://x"]
    assert sweep_mod.metrics_sources("f", "http://nothing", {}) == ["http://nothing"]
    assert sweep_mod.parse_replicas(["f=http://a:1/,http://b:2"]) == {"f": ["http://a:1", "http://b:2"]}
    with pytest.raises(SweepError, match="NAME=http"):
        sweep_mod.parse_replicas(["f=a:1"])


def _rate_point(config: str, rate: float, tok_s: float, user: float, good: float) -> dict:
    return _point(config, 0, tok_s) | {"users": None, "rate": rate, "goodput_req_s": good, "slo_met_share": 0.5,
                                       "user_tok_s": user, "req_s": 2 * good,
                                       "dispatch_delay_ms": {"count": 10, "p99": 0.0},
                                       "server": {"accept_length": 3.0, "position_acceptance": {"1": 0.9, "2": 0.7}}}


def test_report_at_request_rates_has_goodput_and_the_pareto_curve(tmp_path):
    points = [_rate_point("no-spec", 1, 50, 30, 1.0), _rate_point("no-spec", 3, 120, 20, 1.5),
              _rate_point("dflash-b16", 1, 55, 60, 1.0), _rate_point("dflash-b16", 3, 150, 40, 2.5)]
    meta = {"started": "t0", "finished": "t1", "baseline": "no-spec", "duration_s": 20, "warmup": 2,
            "max_tokens": 128, "temperature": 0, "dataset": "bundled mix", "cpu_count": 2, "rates": [1, 3],
            "arrival": "poisson", "max_in_flight": 64, "warmup_s": 5, "slo_ttft_ms": 2000, "slo_tpot_ms": 100,
            "configs": {}}
    report.write_results(tmp_path, meta, points)
    names = {p.name for p in report.write_report(tmp_path)}
    assert {"pareto.png", "goodput.png", "throughput.png", "report.md"} <= names
    md = (tmp_path / "report.md").read_text()
    assert "TTFT ≤ 2000 ms and TPOT ≤ 100 ms" in md and "poisson arrivals" in md
    sent = report.sent_rate(meta, points[3])
    assert sent and sent != 3      # the seeded draw of 60 arrivals, not the nominal rate
    assert f"| dflash-b16 | 3 | {sent:.2f} | 5.00 | 2.50 | 50% | 150.0 | 1.25× | 40.0 |" in md
    assert "## Acceptance by draft position" in md and "| dflash-b16 | 3 | 0.90 | 0.70 |" in md
    assert "| req/s | dflash-b16 |" in md                   # the speedup table's axis
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert rows[3]["rate"] == "3" and float(rows[3]["goodput_req_s"]) == 2.5


def test_rates_and_slos_are_checked(tmp_path, capsys):
    assert main(["--rates", "0", "--out", str(tmp_path)]) == 2
    assert "--rates and --max-in-flight must be positive" in capsys.readouterr().err
    assert main(["--rates", "1", "--slo-ttft", "-1", "--out", str(tmp_path)]) == 2
    assert "--slo-ttft and --slo-tpot must be positive" in capsys.readouterr().err
