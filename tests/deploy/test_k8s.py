"""deploy/k8s, validated without a cluster: each kustomization rendered by the real `kubectl kustomize`, every
object checked against Kubernetes' OpenAPI schemas (kubernetes-validate, strict), the Prometheus Operator objects
by hand, and the contracts between the objects, the dflash-serve config, the CLI and the router's own parser.
(`kubectl apply --dry-run=client` cannot run offline: even with --validate=false it asks an API server.)"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service.config import ServeConfig, parse_config
from tests.deploy.conftest import REPO, dockerfile_stages, exec_form, tool

K8S = REPO / "deploy" / "k8s"
KUSTOMIZATIONS = {"base": "base", "multinode-tp": "overlays/multinode-tp", "model-fetch": "model-fetch"}
SERVING = ("base", "multinode-tp")  # the renders with replicas and a router
# The schemas of Kubernetes 1.32 (the kubectl these tests were written with); the manifests need >= 1.28 (the
# pod-index label of StatefulSet pods) and use nothing newer.
K8S_VERSION = "1.32.0"
# monitoring.coreos.com/v1: no bundled schema, checked by hand below
CRDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}
API_KEY_SECRET = ("dflash-serve-api-key", "api-key")
EXTERNAL_SECRETS = {"dflash-serve-api-key", "hf-token"}  # created by the user (docs/DEPLOYMENT.md), never rendered
CONFIG_MOUNT = "/etc/dflash-serve"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
REPLICA = {"app.kubernetes.io/name": "dflash-serve", "app.kubernetes.io/component": "replica"}


# ------------------------------------------------------------------------------------------------ helpers
@functools.cache
def _render(name: str) -> tuple[dict, ...]:
    r = subprocess.run([tool("kubectl", "kubectl >= 1.27 (kustomize built in)", min_version=(1, 27)), "kustomize",
                        str(K8S / KUSTOMIZATIONS[name])], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return tuple(d for d in yaml.safe_load_all(r.stdout) if d)


def render(name: str) -> list[dict]:
    return list(_render(name))


def kinds(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in kinds(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} in the render"
    return found[0]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict) -> list[dict]:
    spec = pod_spec(workload)
    return spec.get("initContainers", []) + spec["containers"]


def only_container(workload: dict) -> dict:
    (c,) = pod_spec(workload)["containers"]
    return c


def replica_workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and selects(REPLICA, pod_labels(d))]


def port(container: dict, name: str) -> int:
    (p,) = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == name]
    return p


def probe_port(container: dict, probe: dict) -> int:
    p = probe["httpGet"]["port"]
    return port(container, p) if isinstance(p, str) else p


def env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def expand(value: str, variables: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command/args; every reference must name a variable of the container."""
    def sub(m: re.Match) -> str:
        assert m.group(1) in variables, f"$({m.group(1)}) is not an env var of the container"
        return variables[m.group(1)]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value)


def config_of(docs: list[dict], workload: dict) -> tuple[dict, ServeConfig, str]:
    """(raw dict, parsed config, path the container reads) of the ConfigMap mounted at CONFIG_MOUNT."""
    c = only_container(workload)
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == CONFIG_MOUNT]
    (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
    cm = one(docs, "ConfigMap", volume["configMap"]["name"])
    raw = yaml.safe_load(cm["data"]["config.yaml"])
    return raw, parse_config(raw), f"{CONFIG_MOUNT}/config.yaml"


def router(docs: list[dict]) -> dict:
    return one(docs, "Deployment", "dflash-serve-router")


def router_args(docs: list[dict]):
    """The router container's args as sglang-router's own parser reads them; every flag spelt out in full
    (argparse would take an abbreviation, which a later sglang-router flag could make ambiguous)."""
    launch = pytest.importorskip("sglang_router.launch_router", reason="sglang-router not installed")
    from sglang_router.router_args import RouterArgs

    d = router(docs)
    c = only_container(d)
    parser = argparse.ArgumentParser(add_help=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    flags = {o for a in parser._actions for o in a.option_strings}
    for a in c["args"]:
        assert not a.startswith("--") or a.split("=")[0] in flags, f"{a}: not an sglang-router flag"
    variables = {"POD_NAMESPACE": d["metadata"]["namespace"]}
    return launch.parse_router_args([expand(a, variables) for a in c["args"]])


def k8s_validate():
    return pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (requirements/test.txt)")


# ------------------------------------------------------------------------------------------------ schemas
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_object_is_valid_for_kubernetes(name):
    kv = k8s_validate()
    docs = render(name)
    assert docs
    for d in docs:
        if d["kind"] in CRDS:
            assert d["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        try:
            kv.validate(d, K8S_VERSION, strict=True)  # strict: an unknown (misspelt) field is an error
        except kv.ValidationError as e:
            pytest.fail(f"{d['kind']}/{d['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}")


def test_the_validator_catches_a_misspelt_field():
    kv = k8s_validate()
    d = yaml.safe_load(yaml.safe_dump(router(render("base"))))
    only_container(d)["livenessprobe"] = only_container(d).pop("livenessProbe")
    with pytest.raises(kv.ValidationError):
        kv.validate(d, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_references_resolve_within_the_render(name):
    """ConfigMaps (hash-suffixed by the generator), PVCs and service accounts a pod names are in the same render
    and namespace; the only outside references are the Secrets the user creates."""
    docs = render(name)
    namespaced = [d for d in docs if d["kind"] != "Namespace"]
    assert {d["metadata"].get("namespace") for d in namespaced} == {"dflash-serve"}
    assert [n["metadata"]["name"] for n in kinds(docs, "Namespace")] in ([], ["dflash-serve"])
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for w in [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")]:
        spec = pod_spec(w)
        for v in spec.get("volumes", []):
            if "configMap" in v:
                assert ("ConfigMap", v["configMap"]["name"]) in names, v
            if "persistentVolumeClaim" in v and name != "model-fetch":
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in names, v
        if "serviceAccountName" in spec:
            assert ("ServiceAccount", spec["serviceAccountName"]) in names
        for c in containers(w):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] in EXTERNAL_SECRETS, ref
    if name == "model-fetch":  # applied next to the base: the same volume
        (v,) = pod_spec(one(render(name), "Job", "dflash-serve-model-fetch"))["volumes"]
        one(render("base"), "PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_no_secret_value_is_committed(name):
    docs = render(name)
    for s in kinds(docs, "Secret"):
        values = {**s.get("data", {}), **s.get("stringData", {})}
        assert not any(values.values()), f"Secret/{s['metadata']['name']} carries a value"
    for w in [d for d in docs if "template" in d.get("spec", {})]:
        for c in containers(w):
            for e in c.get("env", []):
                if re.search(r"KEY|TOKEN|PASSWORD|SECRET", e["name"]):
                    assert "value" not in e, f"{e['name']} has a literal value"
                ref = e.get("valueFrom", {}).get("secretKeyRef", {})
                if ref.get("name") == API_KEY_SECRET[0]:
                    assert not ref.get("optional"), "a missing API key must keep the pod from starting"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_pods_are_hardened(name):
    for w in [d for d in render(name) if d["kind"] in ("Deployment", "StatefulSet", "Job")]:
        spec = pod_spec(w)
        assert spec.get("enableServiceLinks") is False, "Service links would inject DFLASH_SERVE_* variables"
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
        for c in containers(w):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged")
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")


# ------------------------------------------------------------------------------------------------ replicas
@pytest.mark.parametrize("name", SERVING)
def test_config_matches_the_pods(name):
    docs = render(name)
    workloads = replica_workloads(docs)
    assert workloads
    for w in workloads:
        _, config, _ = config_of(docs, w)
        c = only_container(w)
        s = config.server
        assert s.host == "0.0.0.0" and s.metrics and s.device.value == "cuda"
        http = port(c, "http")
        assert s.port == http
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[kind]["httpGet"]["path"] == "/health" and probe_port(c, c[kind]) == s.port, kind
        # a generous start: weights + CUDA graphs take 10-20 min
        start = c["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= 20 * 60
        key = env(c)[s.api_key_env]["valueFrom"]["secretKeyRef"]
        assert (key["name"], key["key"]) == API_KEY_SECRET
        # SIGTERM starts the server's drain; the kubelet must not SIGKILL before it ends
        assert pod_spec(w)["terminationGracePeriodSeconds"] > s.shutdown_grace_seconds
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1


@pytest.mark.parametrize("name", SERVING)
def test_replica_command_is_the_cli(name):
    """The image's ENTRYPOINT is dflash-serve; the args parse with its real parser and read the mounted config
    (every rank's, with its $(POD_INDEX))."""
    from service import launcher
    from service.cli import build_parser

    gpu = dockerfile_stages()["gpu"]
    (entrypoint,) = [exec_form(a) for k, a in gpu["instructions"] if k == "ENTRYPOINT"]
    assert entrypoint == ["dflash-serve"]
    docs = render(name)
    for w in replica_workloads(docs):
        c = only_container(w)
        assert c["image"] == "dflash-serve:gpu" and "command" not in c
        _, config, path = config_of(docs, w)
        for rank in range(w["spec"]["replicas"]):
            args = [expand(a, {"POD_INDEX": str(rank)}) for a in c["args"]]
            a = build_parser().parse_args(args)
            assert a.command == "serve" and a.config == path
            if a.node_rank is not None:
                launcher.with_node_rank(config, a.node_rank)  # raises unless 0 <= rank < nnodes


@pytest.mark.parametrize("name", SERVING)
def test_volumes(name):
    docs = render(name)
    pvc = one(docs, "PersistentVolumeClaim", "dflash-serve-models")
    assert set(pvc["spec"]["accessModes"]) & {"ReadWriteMany", "ReadOnlyMany"}  # shared by pods on many nodes
    assert pvc["spec"]["resources"]["requests"]["storage"]
    for w in replica_workloads(docs):
        c = only_container(w)
        volumes = {v["name"]: v for v in pod_spec(w)["volumes"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        models = mounts["/models"]
        assert models.get("readOnly") is True
        assert volumes[models["name"]]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
        shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
        assert shm["medium"] == "Memory" and shm["sizeLimit"]


def docker_config_as_served(path: Path) -> dict:
    """A compose config less its `fleet` section: compose runs `dflash-serve fleet`, each Kubernetes pod one
    `dflash-serve serve` (the router is its own Deployment), which reads no `fleet`."""
    raw = yaml.safe_load(path.read_text())
    raw.pop("fleet", None)
    return raw


def test_base_config_is_the_gpu_docker_config():
    """base/config.yaml repeats deploy/configs/gpu-qwen3-8b-docker.yaml (kustomize cannot read files outside its
    directory): the same server in compose and in Kubernetes, and the models the model-fetch Job downloads."""
    docs = render("base")
    (w,) = replica_workloads(docs)
    raw, _, _ = config_of(docs, w)
    assert "fleet" not in raw
    assert raw == docker_config_as_served(REPO / "deploy/configs/gpu-qwen3-8b-docker.yaml")


def test_model_fetch_job_fetches_the_base_models():
    from deploy import fetch_models

    (job,) = kinds(render("model-fetch"), "Job")
    c = only_container(job)
    assert c["command"] == ["python3", "/app/deploy/fetch_models.py"]
    args = dict(zip(c["args"][::2], c["args"][1::2]))
    image_config = Path(args["--config"])
    assert image_config.is_relative_to("/app/deploy/configs")  # the Dockerfile's COPY deploy /app/deploy
    in_repo = REPO / image_config.relative_to("/app")
    docs = render("base")
    (w,) = replica_workloads(docs)
    raw, _, _ = config_of(docs, w)
    assert docker_config_as_served(in_repo) == raw
    assert [r for _, r, _ in fetch_models.wanted(in_repo, args["--root"])] == [
        "Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"]
    (mount,) = c["volumeMounts"]
    assert mount["mountPath"] == args["--root"] and not mount.get("readOnly")


def test_sglang_args_parse_with_sglang():
    """The configs' sglang_args (tp_size, nnodes, dist_init_addr...) are real `sglang serve` flags with valid
    values: SGLang's own parser, in a subprocess (importing SGLang takes seconds and should not leak here)."""
    pytest.importorskip("sglang", reason="sglang not installed (scripts/install-cpu.sh)")
    configs = [yaml.safe_dump(config_of(render(n), w)[0]) for n in SERVING for w in replica_workloads(render(n))]
    code = ("import sys, yaml\nfrom service.config import parse_config\nfrom service.sglang_args import "
            "validate_passthrough\nfor text in yaml.safe_load(sys.stdin.read()):\n"
            "    validate_passthrough(parse_config(yaml.safe_load(text)).sglang_args)\n")
    r = subprocess.run([sys.executable, "-c", code], input=yaml.safe_dump(configs), capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


# ------------------------------------------------------------------------------------------------ router
@pytest.mark.parametrize("name", SERVING)
def test_router_finds_the_replicas(name):
    """The router's arguments parse with sglang-router's own parser, and its service discovery matches the
    replica pods: labels, port, namespace."""
    docs = render(name)
    a = router_args(docs)
    assert a.service_discovery
    c = only_container(router(docs))
    namespace = env(c)["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert namespace == "metadata.namespace" and "$(POD_NAMESPACE)" in c["args"]
    assert a.service_discovery_namespace == router(docs)["metadata"]["namespace"]
    workloads = replica_workloads(docs)
    assert workloads
    for w in workloads:
        rc = only_container(w)
        labels = dict(pod_labels(w))
        if w["kind"] == "StatefulSet":  # the controller adds each pod's ordinal: rank 0 only serves HTTP
            for rank in range(1, w["spec"]["replicas"]):
                assert not selects(a.selector, labels | {POD_INDEX_LABEL: str(rank)}), rank
            labels[POD_INDEX_LABEL] = "0"
        assert selects(a.selector, labels), (a.selector, labels)
        assert a.service_discovery_port == port(rc, "http")
        # the router drains as long as the replicas do
        assert a.shutdown_grace_period_secs >= config_of(docs, w)[1].server.shutdown_grace_seconds
    assert not selects(a.selector, pod_labels(router(docs)))
    assert a.port == port(c, "http") and a.host == "0.0.0.0"
    assert a.prometheus_port == port(c, "metrics") and a.prometheus_host == "0.0.0.0"
    assert a.policy == "cache_aware"
    # the router runs as `dflash-serve fleet` runs it on GPU: its defaults (service/router_args.py)
    from service.router_args import DEFAULTS, GPU_DEFAULTS

    for key, value in (DEFAULTS | GPU_DEFAULTS).items():
        if key != "log_level":  # a cluster's log collector takes the router's own level
            assert getattr(a, key) == value, key
    assert pod_spec(router(docs))["terminationGracePeriodSeconds"] > a.shutdown_grace_period_secs
    for kind, path in (("livenessProbe", "/liveness"), ("readinessProbe", "/readiness")):
        assert c[kind]["httpGet"]["path"] == path and probe_port(c, c[kind]) == a.port


def test_router_gets_the_replicas_key_from_the_environment():
    """The router runs service/router_entry.py (sglang_router.launch_router, its --api-key read from the
    environment instead of its command line), and its environment carries the replicas' key."""
    from sglang_ext import names

    docs = render("base")
    c = only_container(router(docs))
    assert c["command"] == ["python3", "-m", "service.router_entry"]
    assert importlib.util.find_spec("service.router_entry") is not None
    source = (REPO / "service/router_entry.py").read_text()
    assert "names.API_KEY" in source and "launch_router" in source
    ref = env(c)[names.API_KEY]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == API_KEY_SECRET
    assert not any(a.startswith("--api-key") for a in c["args"])


def test_router_may_watch_pods():
    docs = render("base")
    spec = pod_spec(router(docs))
    binding = one(docs, "RoleBinding", "dflash-serve-router")
    assert binding["roleRef"]["kind"] == "Role"
    role = one(docs, "Role", binding["roleRef"]["name"])
    assert any("" in r["apiGroups"] and "pods" in r["resources"] and {"get", "list", "watch"} <= set(r["verbs"])
               for r in role["rules"])
    assert {"kind": "ServiceAccount", "name": spec["serviceAccountName"],
            "namespace": router(docs)["metadata"]["namespace"]} in binding["subjects"]


@pytest.mark.parametrize("name", SERVING)
def test_services_select_their_pods(name):
    docs = render(name)
    svc = one(docs, "Service", "dflash-serve")
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert selects(svc["spec"]["selector"], pod_labels(router(docs)))
    assert not any(selects(svc["spec"]["selector"], pod_labels(w)) for w in replica_workloads(docs))
    rc = only_container(router(docs))
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert set(ports) == {"http", "metrics"}
    for p in ports.values():
        assert p["port"] == port(rc, p["targetPort"])
    assert ports["http"]["port"] == 30000 and ports["metrics"]["port"] == 29000
    headless = [s for s in kinds(docs, "Service") if s["spec"].get("clusterIP") == "None"]
    for w in replica_workloads(docs):
        assert any(selects(s["spec"]["selector"], pod_labels(w)) for s in headless), w["metadata"]["name"]


# ------------------------------------------------------------------------------------------------ multinode
def test_multinode_is_one_statefulset_of_ranks():
    docs = render("multinode-tp")
    # the base's single-GPU replicas are dropped
    assert [d["metadata"]["name"] for d in kinds(docs, "Deployment")] == ["dflash-serve-router"]
    (sts,) = kinds(docs, "StatefulSet")
    assert replica_workloads(docs) == [sts]
    _, config, _ = config_of(docs, sts)
    sa = config.sglang_args
    spec = sts["spec"]
    assert sa["nnodes"] == spec["replicas"] >= 2
    gpus = int(only_container(sts)["resources"]["limits"]["nvidia.com/gpu"])
    assert sa["tp_size"] == sa["nnodes"] * gpus
    # both ranks start at once (pod 0 is Ready only after pod 1 joined)
    assert spec["podManagementPolicy"] == "Parallel"
    # rank 0's address is its stable name under the StatefulSet's headless Service, published before Ready
    host, dist_port = sa["dist_init_addr"].rsplit(":", 1)
    assert host == f"{sts['metadata']['name']}-0.{spec['serviceName']}"
    svc = one(docs, "Service", spec["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert selects(svc["spec"]["selector"], pod_labels(sts))
    c = only_container(sts)
    assert int(dist_port) == port(c, "dist")
    # the rank: the pod's ordinal label, which the router's selector uses to pick rank 0
    assert env(c)["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.labels['{POD_INDEX_LABEL}']"
    assert c["args"][-2:] == ["--node-rank", "$(POD_INDEX)"]
    assert "node_rank" not in sa, "the rank comes from the command line, not the shared config"
    assert router_args(docs).selector.get(POD_INDEX_LABEL) == "0"


def test_multinode_config_is_the_base_config_plus_tensor_parallelism():
    base_docs, tp_docs = render("base"), render("multinode-tp")
    base = config_of(base_docs, replica_workloads(base_docs)[0])[0]
    tp = config_of(tp_docs, replica_workloads(tp_docs)[0])[0]
    added = {k: v for k, v in tp["sglang_args"].items() if k not in base["sglang_args"]}
    assert set(added) == {"tp_size", "nnodes", "dist_init_addr"}
    assert {**tp, "sglang_args": {k: v for k, v in tp["sglang_args"].items() if k not in added}} == base


def test_nonzero_ranks_answer_health_in_this_sglang():
    """The multinode probes hit /health on every rank: SGLang's ranks >= 1 run no API server but start a stub
    health server on the same port once their schedulers are up. Read from the installed SGLang's source."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang not installed (scripts/install-cpu.sh)")
    root = Path(list(spec.submodule_search_locations)[0])
    common = (root / "srt/utils/common.py").read_text()
    stub = common[common.index("def launch_dummy_health_check_server"):]
    assert '@app.get("/health")' in stub[:stub.index("\ndef ")]
    engine = (root / "srt/entrypoints/engine.py").read_text()
    branch = engine[engine.index("if get_parallel().node_rank >= 1:"):]
    assert "launch_dummy_health_check_server(" in branch[:6000]


# ------------------------------------------------------------------------------------------------ monitoring
def _duration(s: str) -> float:
    m = re.fullmatch(r"(\d+)(ms|s|m)", s)
    assert m, f"not a Prometheus duration: {s!r}"
    return int(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[m.group(2)]


def _rules_jobs() -> set[str]:
    return set(re.findall(r'job="([^"]+)"', (REPO / "deploy/prometheus/rules/dflash.yml").read_text()))


def _compose_scrape_configs() -> list[dict]:
    return yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())["scrape_configs"]


def _compose_replica_job() -> tuple[str, dict]:
    """(job name, SGLang metric-name relabeling) of the compose Prometheus's replica job: the one that relabels
    sglang_* names."""
    found = [(j["job_name"], r) for j in _compose_scrape_configs() for r in j.get("metric_relabel_configs", [])
             if "sglang" in str(r.get("regex", ""))]
    assert len(found) == 1, found
    return found[0]


def _compose_router_job(metrics_port: int) -> str:
    (name,) = [j["job_name"] for j in _compose_scrape_configs() for sc in j.get("static_configs", [])
               for t in sc["targets"] if t.endswith(f":{metrics_port}")]
    return name


@pytest.mark.parametrize("name", SERVING)
def test_podmonitor_scrapes_the_replicas(name):
    docs = render(name)
    (pm,) = kinds(docs, "PodMonitor")
    spec = pm["spec"]
    assert set(spec) <= {"jobLabel", "selector", "podMetricsEndpoints", "namespaceSelector", "podTargetLabels"}
    workloads = replica_workloads(docs)
    assert workloads
    for w in workloads:
        assert selects(spec["selector"]["matchLabels"], pod_labels(w))
        # the replicas' job name in deploy/prometheus (its rules count up{job=...})
        job = pod_labels(w)[spec["jobLabel"]]
        assert job == _compose_replica_job()[0] and job in _rules_jobs()
        for ep in spec["podMetricsEndpoints"]:
            port(only_container(w), ep["port"])  # a named port of the pod
    assert not selects(spec["selector"]["matchLabels"], pod_labels(router(docs)))
    (ep,) = spec["podMetricsEndpoints"]
    assert ep["path"] == "/metrics" and _duration(ep["interval"]) == 5
    assert _duration(ep["scrapeTimeout"]) < _duration(ep["interval"])
    compose = _compose_replica_job()[1]
    # the fleet dashboard's series are by `replica`, the label compose's fleet gives its targets
    assert {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "replica"} in ep["relabelings"]
    (relabel,) = ep["metricRelabelings"]
    assert relabel == {"sourceLabels": compose["source_labels"], "regex": compose["regex"],
                       "targetLabel": compose["target_label"], "replacement": compose["replacement"]}


@pytest.mark.parametrize("name", SERVING)
def test_servicemonitor_scrapes_the_router(name):
    docs = render(name)
    (sm,) = kinds(docs, "ServiceMonitor")
    spec = sm["spec"]
    assert set(spec) <= {"jobLabel", "selector", "endpoints", "namespaceSelector"}
    matched = [s for s in kinds(docs, "Service") if selects(spec["selector"]["matchLabels"], s["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in matched] == ["dflash-serve"]
    (ep,) = spec["endpoints"]
    assert ep["port"] in {p["name"] for p in matched[0]["spec"]["ports"]} and ep["port"] == "metrics"
    assert ep["path"] == "/metrics" and _duration(ep["scrapeTimeout"]) < _duration(ep["interval"])
    # the router's job name in deploy/prometheus (not the Service name, dflash-serve: the replicas' job)
    (job,) = [r["replacement"] for r in ep.get("relabelings", []) if r.get("targetLabel") == "job"]
    assert job == _compose_router_job(router_args(docs).prometheus_port) != _compose_replica_job()[0]
    assert job in _rules_jobs()


# ------------------------------------------------------------------------------------------------ rules, dashboards
def test_the_monitoring_files_are_what_the_generator_writes():
    from deploy import k8s_monitoring

    for path, text in k8s_monitoring.render().items():
        assert path.read_text() == text, f"{path} is stale: python -m deploy.k8s_monitoring rewrites it"


@pytest.mark.parametrize("name", SERVING)
def test_the_prometheusrule_is_the_compose_stacks_rules(name, tmp_path):
    """The Prometheus Operator's PrometheusRule carries deploy/prometheus/rules unchanged, and promtool accepts
    its groups as a rules file."""
    (rule,) = kinds(render(name), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and set(rule["spec"]) == {"groups"}
    shipped = [g for f in sorted((REPO / "deploy/prometheus/rules").glob("*.yml"))
               for g in yaml.safe_load(f.read_text())["groups"]]
    assert rule["spec"]["groups"] == shipped
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert alerts and all(r["labels"]["severity"] in ("warning", "critical") for r in alerts)
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    r = subprocess.run([tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", SERVING)
def test_every_dashboard_is_a_configmap_for_grafanas_sidecar(name):
    import json

    maps = [m for m in kinds(render(name), "ConfigMap") if m["metadata"].get("labels", {}).get("grafana_dashboard")]
    files = sorted((REPO / "deploy/grafana/dashboards").glob("*.json"))
    assert len(maps) == len(files) == 4
    by_key = {k: v for m in maps for k, v in m["data"].items()}
    for f in files:
        assert json.loads(by_key[f"dflash-serve-{f.name}"]) == json.loads(f.read_text()), f.name
    for m in maps:
        assert m["metadata"]["labels"]["grafana_dashboard"] == "1"   # the sidecar's default label and value
        assert m["metadata"]["namespace"] == "dflash-serve"
        assert len(json.dumps(m)) < 262144   # kubectl apply's last-applied annotation must hold it
