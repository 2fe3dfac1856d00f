"""The monitoring stack without Docker: a local Prometheus on the compose stack's config, a chat load, and the
Grafana dashboards' PromQL with their template variables filled in as Grafana would.

Used by tests/deploy (every dashboard panel must return data from a real server) and by
`python3 -m deploy.render_dashboards` (PNG pictures of the dashboards).
"""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
RULES_DIR = DEPLOY / "prometheus" / "rules"
DASHBOARDS_DIR = DEPLOY / "grafana" / "dashboards"
SCRAPE_JOB = "dflash-serve"
LEARN_JOB = "dflash-learn"  # `dflash-serve learn`: its own port (learning.metrics_port)
ROUTER_JOB = "dflash-router"


# ------------------------------------------------------------------------------------------------ Prometheus
class PrometheusError(RuntimeError):
    pass


class PromClient:
    """The few Prometheus HTTP API calls the dashboards need."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def _get(self, path: str, params: dict | list | None = None, timeout: float = 30):
        query = "?" + urllib.parse.urlencode(params or {}, doseq=True) if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=timeout) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}") if e.headers.get("Content-Type", "").startswith("application/json") \
                else {"error": str(e)}
            raise PrometheusError(f"{path} {params}: {body.get('error', e)}") from None
        except (urllib.error.URLError, OSError) as e:
            raise PrometheusError(f"cannot reach Prometheus at {self.url}: {getattr(e, 'reason', e)}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
        return self._get("/api/v1/query", params)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        return self._get("/api/v1/query_range", params)["result"]

    def label_values(self, label: str, match: str | None = None) -> list[str]:
        params = [("match[]", match)] if match else []
        return self._get(f"/api/v1/label/{label}/values", params)

    def rules(self) -> list[dict]:
        return self._get("/api/v1/rules")["groups"]

    def targets(self) -> list[dict]:
        return self._get("/api/v1/targets")["activeTargets"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False


def stack_config(targets: list[str], scrape_interval: str = "1s", rules_dir: Path = RULES_DIR,
                 targets_file: Path | None = None, router_targets: list[str] = (),
                 learner_targets: list[str] = ()) -> dict:
    """deploy/prometheus/prometheus.yml with a faster clock, its dflash-serve job pointed at `targets` or, as in
    the stack, at a fleet's file_sd `targets_file`, its router job at `router_targets` and its learner job at
    `learner_targets` (each dropped if none)."""
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    cfg["global"] |= {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval}
    cfg["rule_files"] = [str(rules_dir / Path(p).name) for p in cfg["rule_files"]]
    cfg.pop("alerting", None)          # the stack's Alertmanager; tests/deploy/test_alerting.py runs a real one
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    job = jobs[SCRAPE_JOB]
    job.pop("file_sd_configs", None)
    job.pop("static_configs", None)
    if targets_file is not None:
        job["file_sd_configs"] = [{"files": [str(targets_file)], "refresh_interval": "1s"}]
    if targets:
        job["static_configs"] = [{"targets": list(targets)}]
    cfg["scrape_configs"] = [job]
    if router_targets:
        router = jobs[ROUTER_JOB]
        router["static_configs"] = [{"targets": list(router_targets)}]
        cfg["scrape_configs"].append(router)
    if learner_targets:
        learner = jobs[LEARN_JOB]
        learner.pop("file_sd_configs", None)
        learner["static_configs"] = [{"targets": list(learner_targets)}]
        cfg["scrape_configs"].append(learner)
    for j in cfg["scrape_configs"]:
        j["scrape_interval"] = j["scrape_timeout"] = scrape_interval
    return cfg


class LocalPrometheus:
    """A real `prometheus` binary on a free loopback port, storing into `workdir`, scraping `targets`."""

    def __init__(self, targets: list[str], workdir: Path, scrape_interval: str = "1s", binary: str | None = None,
                 targets_file: Path | None = None, router_targets: list[str] = (), learner_targets: list[str] = ()):
        from harness.server import free_port

        self.binary = binary or shutil.which("prometheus")
        if not self.binary:
            raise FileNotFoundError("prometheus binary not found (Debian: apt-get install prometheus)")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(
            stack_config(targets, scrape_interval, targets_file=targets_file, router_targets=router_targets,
                         learner_targets=learner_targets),
            sort_keys=False))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None
        self.client = PromClient(self.url)

    def start(self, timeout: float = 60) -> LocalPrometheus:
        log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d"],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.client.ready():
                return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"prometheus not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def wait_for_scrapes(self, expr: str = f'up{{job="{SCRAPE_JOB}"}} == 1', timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.client.query(expr):
                return
            time.sleep(0.5)
        raise RuntimeError(f"no result for {expr} after {timeout:.0f}s; targets: {self.client.targets()}")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> LocalPrometheus:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------------------------------------ load
PROMPTS = [
    "def quicksort(xs):\n",
    "Write a haiku about the sea.",
    "import json\n\ndef load(path):\n",
    "Explain speculative decoding in one sentence.",
    "for i in range(10):\n",
    "class Stack:\n    def __init__(self):\n",
]


@dataclass
class LoadResult:
    requests: int = 0
    failures: list[str] = field(default_factory=list)
    output_chunks: int = 0
    start: float = 0.0
    end: float = 0.0


def chat_load(base_url: str, model: str, seconds: float, concurrency: int = 4, max_tokens: int = 48,
              api_key: str = "unused") -> LoadResult:
    """`concurrency` closed-loop users streaming OpenAI chat completions for `seconds`."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=120)
    result = LoadResult(start=time.time())
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def user(k: int) -> None:
        i = k
        while time.monotonic() < deadline:
            prompt = PROMPTS[i % len(PROMPTS)]
            i += concurrency
            try:
                stream = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                    temperature=0.7 if i % 2 else 0.0, stream=True)
                chunks = sum(1 for c in stream if c.choices and c.choices[0].delta.content)
                with lock:
                    result.requests += 1
                    result.output_chunks += chunks
            except Exception as e:  # noqa: BLE001 -- every failure is reported by the caller
                with lock:
                    result.failures.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=user, args=(k,), daemon=True) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.end = time.time()
    return result


# ------------------------------------------------------------------------------------------------ dashboards
@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    panel_type: str
    ref: str
    expr: str
    legend: str
    instant: bool
    fmt: str


def load_dashboards(directory: Path = DASHBOARDS_DIR) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}


def panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' collapsed children included."""
    out = []
    for p in dashboard.get("panels", []):
        out.append(p)
        out.extend(p.get("panels", []))
    return [p for p in out if p.get("type") != "row"]


def panel_queries(name: str, dashboard: dict) -> list[PanelQuery]:
    return [PanelQuery(name, p["title"], p["type"], t["refId"], t["expr"], t.get("legendFormat", ""),
                       bool(t.get("instant")) and not t.get("range", False), t.get("format", "time_series"))
            for p in panels(dashboard) for t in p.get("targets", []) if not t.get("hide")]


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(?P<match>.+?)\s*,\s*)?(?P<label>\w+)\s*\)\s*$")


def variable_query(var: dict) -> str:
    q = var.get("query")
    return q.get("query", "") if isinstance(q, dict) else (q or "")


def regex_value(values: list[str]) -> str:
    """Grafana's formatting of a multi-value variable inside =~ "..." (regex escaped, alternation)."""
    escaped = [re.sub(r"([\\^$*+?.()|\[\]{}/])", r"\\\\\1", v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def resolve_variables(dashboard: dict, client: PromClient, chosen: dict[str, list[str]] | None = None,
                      ) -> dict[str, list[str]]:
    """Each query variable's options, as Grafana computes them (label_values through the label API), in order;
    a variable's match may use earlier ones. `chosen` selects values (default: all options)."""
    chosen = chosen or {}
    values: dict[str, list[str]] = {}
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        m = _LABEL_VALUES.match(variable_query(var))
        if not m:
            raise ValueError(f"variable {var['name']}: only label_values(...) queries are supported")
        match = substitute(m.group("match"), values) if m.group("match") else None
        options = sorted(client.label_values(m.group("label"), match))
        values[var["name"]] = [v for v in options if v in chosen[var["name"]]] if var["name"] in chosen else options
    return values


def substitute(expr: str, variables: dict[str, list[str]], rate_interval: str = "1m", range_: str = "1h",
               interval: str = "15s") -> str:
    """Fill in template variables and Grafana's built-in $__ intervals."""
    out = expr.replace("$__rate_interval", rate_interval).replace("$__range", range_) \
        .replace("$__interval", interval)
    for name in sorted(variables, key=len, reverse=True):
        value = regex_value(variables[name]) if variables[name] else "__none__"
        out = out.replace("${" + name + "}", value).replace("$" + name, value)
    return out


def finite_points(result: list[dict]) -> int:
    """Finite samples in a query (or query_range) result."""
    n = 0
    for series in result:
        points = series.get("values") or ([series["value"]] if "value" in series else [])
        n += sum(1 for _, v in points if math.isfinite(float(v)))
    return n


def legend(fmt: str, labels: dict[str, str], fallback: str) -> str:
    if not fmt or fmt == "__auto":
        inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
        return f"{{{inner}}}" if inner else fallback
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


_METRIC = re.compile(r"(?<![\w:$\"])((?:sglang:|dflash_)[\w:]*|dflash:[\w:]+)")


def metric_names(expr: str) -> set[str]:
    """sglang:* / dflash_* / dflash:* names in a PromQL expression (histogram suffixes kept)."""
    return set(_METRIC.findall(re.sub(r'"[^"]*"', '""', expr)))
