"""dflash-serve configuration: one YAML file, validated by pydantic v2.

Every error names the field (`speculative.draft_model_path: ...`). Relative paths are
resolved against the config file's directory, so a config can travel with its models.
SGLang arguments without a field here go in `sglang_args` and are checked against
SGLang's own parser by the preflight (`service.sglang_args`).
"""
from __future__ import annotations

import dataclasses
import os
import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, PrivateAttr,
                      ValidationError, ValidationInfo, create_model, field_validator, model_validator)

from service.models import HubModel, parse_ref

from sglang_ext.controller.config import ControllerConfig
from sglang_ext.settings import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_PAUSE_LEASE_SECONDS, AdaptiveSettings


class ConfigError(ValueError):
    """A config problem, phrased for a one-line CLI error."""


def _resolve(p: Path, info: ValidationInfo) -> Path:
    """Relative paths are relative to the config file's directory (validation context ``base``)."""
    p = Path(os.path.expanduser(str(p)))
    base = (info.context or {}).get("base")
    return p if p.is_absolute() or base is None else (Path(base) / p).resolve()


ConfigPath = Annotated[Path, AfterValidator(_resolve)]


def _model_ref(value: Any, info: ValidationInfo) -> Path | HubModel:
    """A folder or a Hugging Face id (service/models.py parse_ref: the rule that tells them apart)."""
    if isinstance(value, HubModel):
        return value
    if not isinstance(value, (str, Path)) or not str(value):
        raise ValueError("expected a folder or a Hugging Face id (org/name)")
    return parse_ref(str(value), (info.context or {}).get("base"))


# A model: a folder, relative paths against the config's folder, or a Hugging Face id (org/name[@revision]) read
# from the local cache and downloaded only with model.download (service/models.py).
ModelRef = Annotated[Path | HubModel, PlainValidator(_model_ref), PlainSerializer(str, return_type=str)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class ModelConfig(_Strict):
    path: ModelRef = Field(
        description="Target model: a folder (Hugging Face format), or a Hugging Face id `org/name` (`@revision` "
                    "optional) read from the local Hugging Face cache; an id unless a folder of that name exists "
                    "next to the config (`./org/name` is always a folder).")
    tokenizer: ModelRef | None = Field(None, description="Tokenizer folder or Hugging Face id; default: the model's.")
    download: bool = Field(
        False, description="Download a Hugging Face id of model.path, model.tokenizer or "
                           "speculative.draft_model_path that is not complete in the local cache when the server "
                           "starts (huggingface_hub's snapshot download: complete files kept, a cut-off one "
                           "resumed; every file checked against the hub's listing). Off: only the cache is read, "
                           "and a missing model is an error naming what to run.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights/activations dtype; on CPU float32 is faster (no AMX) and bit-exact.")
    served_name: str | None = Field(
        None, description="Model name clients send and /v1/models lists; default: the path (a Hugging Face id "
                          "as written).")
    context_length: int | None = Field(None, gt=0, description="Override the model's context length; default: the model's.")


class ServerConfig(_Strict):
    host: str = Field("127.0.0.1", description="Bind address; loopback unless you mean to expose it.")
    port: int = Field(30000, ge=1, le=65535, description="Port; a port in use is refused before start.")
    device: Device = Field(Device.cpu, description="cpu (activates the CPU layer) or cuda.")
    api_key_env: str | None = Field(
        None, description="Name of the environment variable holding the API key (never the key itself): the client "
                          "key, for generation and the other non-admin routes.")
    admin_api_key_env: str | None = Field(
        None, description="Name of the environment variable holding the admin key (never the key itself): the only "
                          "key SGLang's admin routes (/configure_logging, /flush_cache, /abort_request, "
                          "/pause_generation, /update_weights_*, LoRA loading, profiling, ...) and the fleet router's "
                          "control plane (/workers) accept. Unset: those routes are refused (403) to every client. "
                          "Must differ from the API key.")
    metrics: bool = Field(True, description="Expose Prometheus metrics on /metrics.")
    cpu_threads: int | Literal["auto"] = Field(
        "auto", description="Torch threads per server process on CPU; auto = cores - 1 (min 1), which "
                            "leaves a core for the HTTP/tokenizer processes. More threads than free cores "
                            "makes OpenMP spin and is many times slower.")
    cpu_cores: list[int] | None = Field(
        None, min_length=1, description="CPU cores (ids) the server runs on, and its `auto` thread count counts; "
                                        "default: all this process may use. `dflash-serve fleet` gives each replica "
                                        "its share.")
    max_total_tokens: int | None = Field(None, gt=0, description="KV cache size in tokens; default: SGLang's.")
    max_running_requests: int | None = Field(
        None, gt=0, description="Concurrent requests in the decode batch; default: SGLang's.")
    max_request_bytes: int | None = Field(
        DEFAULT_MAX_REQUEST_BYTES, gt=0, description="Largest request body accepted (413 above it); null: no limit. "
                                           "Bounds the CPU a single request can spend in tokenization.")
    scheduler_stopping_routes: bool = Field(
        False, description="Open SGLang's admin routes that can stop the scheduler with one call to the admin "
                           "key: the expert-distribution recorder (/start_expert_distribution_record, its stop and "
                           "dump), which raises in the scheduler, and so ends the server, unless the server records "
                           "expert distributions (sglang_args.expert_distribution_recorder_mode); and the routes that "
                           "make the scheduler join or use a torch.distributed group with a peer the request names "
                           "(/init_weights_update_group, /update_weights_from_distributed, "
                           "/init_weights_send_group_for_remote_instance, /send_weights_to_remote_instance), where it "
                           "waits for the peer or raises; and /release_memory_occupation and "
                           "/resume_memory_occupation, which raise in the scheduler when the server is busy or the "
                           "memory was not released. Off: they answer 403 to every key.")
    shutdown_grace_seconds: float = Field(
        50, gt=0, description="After SIGTERM/SIGINT, how long in-flight requests may take to finish (new ones "
                              "get 503) before the launcher kills the server. Keep it below the orchestrator's "
                              "own grace period (compose stop_grace_period).")
    pause_lease_seconds: float | None = Field(
        DEFAULT_PAUSE_LEASE_SECONDS, gt=0,
        description="A pause (/pause_generation) or weight-update session (/begin_weight_update) is a lease its "
                    "client renews with every pause or weight-update call: after this long without one (none in "
                    "flight) the server takes its client for gone, ends an open session with the drafter's weights "
                    "rolled back to those it began with, and resumes generation. A learner killed mid-swap thus "
                    "leaves the server serving its old drafter (docs/LEARNING.md); to hold a pause longer, call "
                    "/pause_generation again within the lease. null: held until the client ends it (upstream's "
                    "behaviour).")

    @model_validator(mode="after")
    def _two_key_variables(self):
        if self.admin_api_key_env is not None and self.admin_api_key_env == self.api_key_env:
            raise ValueError(f"admin_api_key_env: names the same variable as api_key_env ({self.api_key_env}); the "
                             f"admin key must be a different key, in its own variable")
        return self

    @field_validator("cpu_threads")
    @classmethod
    def _threads_positive(cls, v):
        if v != "auto" and v < 1:
            raise ValueError("must be >= 1 or 'auto'")
        return v

    @field_validator("cpu_cores")
    @classmethod
    def _cores_exist(cls, v):
        if v is None:
            return v
        usable = available_cores()
        missing = sorted(set(v) - set(usable))
        if missing:
            raise ValueError(f"cores {missing} are not available to this process (available: {usable})")
        if len(set(v)) != len(v):
            raise ValueError("lists a core twice")
        return v

    def resolved_cpu_threads(self) -> int:
        if self.cpu_threads != "auto":
            return int(self.cpu_threads)
        cores = len(self.cpu_cores) if self.cpu_cores else len(available_cores())
        # One core is left to the HTTP/tokenizer processes, unless that would leave the model none.
        return max(1, cores - 1)


def available_cores() -> list[int]:
    """The CPU cores this process may run on (its affinity: a container's cpuset, taskset)."""
    return sorted(os.sched_getaffinity(0))


def _controller_fields() -> dict[str, Any]:
    """speculative.adaptive's controller keys: ControllerConfig's own fields and defaults (one definition; its
    validation, which names the field, runs once when the config is loaded)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(ControllerConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out[f.name] = (Any, default)
    return out


class _AdaptiveExtras(_Strict):
    """speculative.adaptive: the block-size controller of dflash_adaptive (docs/ADAPTIVE.md). Every field of
    sglang_ext/controller/config.py ControllerConfig (documented there; the defaults are the tested ones), plus
    cost_profile and learn_costs."""

    cost_profile: ConfigPath | None = Field(
        None, description="Step-cost profile JSON: a measured table {batch_buckets, block_sizes, seconds} (e.g. "
                          "written by benchmarks/adaptive_throughput.py) or a roofline description; default: the "
                          "packaged H200 roofline (modelled, not measured).")
    learn_costs: bool = Field(
        True, description="Refine the cost table online from measured step times (off: the profile is the truth).")
    _settings: AdaptiveSettings = PrivateAttr()

    @model_validator(mode="after")
    def _build_settings(self):
        controller = ControllerConfig.from_dict({name: getattr(self, name) for name in CONTROLLER_KEYS})
        self._settings = AdaptiveSettings(controller, None if self.cost_profile is None else str(self.cost_profile),
                                          self.learn_costs)
        return self

    @property
    def settings(self) -> AdaptiveSettings:
        """The worker's settings, built and validated once (at load)."""
        return self._settings


CONTROLLER_KEYS = tuple(f.name for f in dataclasses.fields(ControllerConfig))
AdaptiveConfig = create_model("AdaptiveConfig", __base__=_AdaptiveExtras, **_controller_fields())


class SpeculativeConfig(_Strict):
    algorithm: Literal["none", "dflash", "dflash_adaptive"] = Field(
        "none", description="none: plain decoding; dflash: upstream DFlash (fixed block); dflash_adaptive: "
                            "DFlash whose verify width the controller picks every decode step.")
    draft_model_path: ModelRef | None = Field(
        None, description="z-lab-format DFlash drafter: a folder or a Hugging Face id, as model.path.")
    block_size: int | None = Field(
        None, ge=2, description="dflash only: tokens verified per step; defaults to the drafter's block_size.")
    adaptive: AdaptiveConfig | None = Field(  # type: ignore[valid-type]
        None, description="dflash_adaptive only: controller settings (defaults when absent).")

    @model_validator(mode="after")
    def _needs_drafter(self):
        if self.algorithm != "none" and self.draft_model_path is None:
            raise ValueError(f"draft_model_path is required when algorithm is {self.algorithm!r}")
        if self.algorithm == "dflash_adaptive" and self.block_size is not None:
            raise ValueError("block_size is not used by dflash_adaptive (it drafts the drafter's full block and "
                             "verifies a prefix); choose widths with speculative.adaptive.candidates")
        if self.adaptive is not None and self.algorithm != "dflash_adaptive":
            raise ValueError("adaptive settings need algorithm: dflash_adaptive")
        if self.algorithm == "dflash_adaptive" and self.adaptive is None:
            object.__setattr__(self, "adaptive", AdaptiveConfig())  # the defaults, validated like a written section
        return self

    def adaptive_settings(self) -> AdaptiveSettings:
        """The worker's settings for dflash_adaptive (built at load)."""
        if self.adaptive is None:
            raise ValueError("adaptive settings exist only for algorithm: dflash_adaptive")
        return self.adaptive.settings


class RouterConfig(_Strict):
    """fleet.router: SGLang's own router (`sglang-router`) in front of the replicas."""

    policy: Literal["cache_aware", "round_robin", "power_of_two", "random"] = Field(
        "cache_aware", description="cache_aware: a prompt goes to the replica whose prefix cache matches it best "
                                   "(balanced by load); round_robin; power_of_two: the less loaded of two random "
                                   "replicas; random.")
    metrics_port: int = Field(29000, ge=1, le=65535, description="The router's Prometheus /metrics port.")
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Other sglang-router arguments by flag name without dashes (e.g. cache_threshold: 0.3); "
                    "validated against its parser. The fleet's own defaults (no circuit breaker: 0.3.2's counts clients' "
                    "4xx; health checks every second, out after 2 failures; retries backing off from 0.3 s, doubling; "
                    "log level warn; on GPU, balance_abs_threshold 2 and balance_rel_threshold 1.2, so short "
                    "prompts spread over the GPUs) yield to them.")


class FleetConfig(_Strict):
    """fleet: `dflash-serve fleet` runs `replicas` servers of this config behind the router on server.port."""

    replicas: int = Field(2, ge=1, le=64, description="Servers behind the router (`--replicas` overrides); on CPU at "
                                                     "most one per core.")
    replica_base_port: int | None = Field(
        None, ge=1, le=65535, description="Replica i listens on replica_base_port + i; default server.port + 1.")
    gpus: list[int] | None = Field(
        None, min_length=1, description="cuda: the GPU of each replica in order, one replica per device; "
                                        "default 0 .. replicas-1.")
    advertise_host: str | None = Field(
        None, description="The host name Prometheus reaches the replicas at (the targets file); default: "
                          "server.host, or this machine's name when that is a wildcard (0.0.0.0, ::).")
    prometheus_targets_file: ConfigPath | None = Field(
        None, description="Write the replicas as a Prometheus file_sd targets file here (compose mounts it into "
                          "Prometheus, which re-reads it on change).")
    startup_timeout_seconds: float = Field(
        1800, gt=0, description="How long a replica may take to become healthy before the fleet gives up (exit 1).")
    router: RouterConfig = Field(RouterConfig(), description="SGLang's router in front of the replicas.")


class LearningConfig(_Strict):
    """learning: the drafter learns the traffic it serves (docs/LEARNING.md). Off by default. On, every server of
    this config keeps finished requests' token ids in `store_dir` (bounded), and `dflash-serve learn` -- its own
    process -- fine-tunes a copy of the serving drafter on them, gates it, and hot-swaps it into the servers."""

    enabled: bool = Field(False, description="Capture served traffic for `dflash-serve learn` (token ids only).")
    store_dir: ConfigPath | None = Field(
        None, description="Where the servers keep captured token ids (0700, append-only segments); required when "
                          "enabled. Per-request opt-out: custom_params {\"dflash_capture\": false}.")
    work_dir: ConfigPath | None = Field(
        None, description="The learner's drafter versions, state and decision log; default: store_dir/../learner.")
    max_store_mb: int = Field(256, gt=0, description="Store size limit; the oldest segments are deleted past it.")
    max_age_hours: float = Field(168, gt=0, description="Captured requests older than this are deleted.")
    threads: int = Field(1, ge=1, description="Torch threads of `dflash-serve learn` (its own budget: keep it off "
                                              "the servers' cores).")
    device: str = Field(
        "cpu", description="Where `dflash-serve learn` loads the target and trains the drafter: cpu, cuda or cuda:N "
                           "(a GPU of its own: the servers' GPUs have no memory to spare).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="The learner's target weights, and the drafter's matmuls (autocast; its own weights and "
                            "optimizer state stay float32); auto: float32 on cpu, bfloat16 on cuda.")
    dataset: ConfigPath | None = Field(
        None, description="The original mix: a JSONL file of prompts like the drafter's training data, one request "
                          "a line, {\"prompt\": text} or {\"messages\": [{\"role\", \"content\"}, ...]}; the "
                          "target's own answers to them are what each batch mixes in (original_share) and what "
                          "max_original_loss is measured on. Required for every target but the bundled tiny pair, "
                          "whose default is its standard-library mix.")
    steps: int = Field(150, ge=1, description="Fine-tuning steps per learning round.")
    original_share: float = Field(
        0.25, ge=0, lt=1, description="Share of each batch drawn from the drafter's original data (regenerated "
                                      "from its training prompts), so the old domain is not forgotten.")
    min_sequences: int = Field(48, ge=8, description="Captured requests needed before a round runs.")
    holdout_fraction: float = Field(0.2, gt=0, lt=1, description="Most recent captured requests held out for "
                                                                "the gate (never trained on).")
    promote_margin: float = Field(
        0.05, ge=0, description="The gate: the candidate's tokens per step on held-out recent traffic must beat "
                                "the serving drafter's by this fraction.")
    promote_confidence: float = Field(
        0.95, ge=0.5, lt=1, description="The gate: the share of bootstrap resamples of the held-out slice in which "
                                        "the candidate must beat the serving drafter (a gain that is not noise).")
    max_original_loss: float = Field(
        0.05, ge=0, description="The gate: the candidate may lose at most this fraction of the config's own "
                                "drafter's tokens per step on the original mix (across all promotions).")
    interval_seconds: float = Field(300, gt=0, description="`dflash-serve learn --loop`: seconds between rounds.")
    metrics_port: int | None = Field(
        9401, ge=1, le=65535, description="The learner's own Prometheus /metrics port (null: none).")
    servers: list[str] | None = Field(
        None, min_length=1, description="Base URLs the learner hot-swaps (every replica); default: this config's "
                                        "server, or with `--fleet` every replica of its fleet.")


    @field_validator("device")
    @classmethod
    def _a_torch_device(cls, v):
        if re.fullmatch(r"cpu|cuda(:\d+)?", v) is None:
            raise ValueError(f"{v!r}: expected cpu, cuda or cuda:N")
        return v

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"


class ServeConfig(_Strict):
    model: ModelConfig = Field(description="The target model.")
    server: ServerConfig = Field(ServerConfig(), description="The HTTP server.")
    speculative: SpeculativeConfig = Field(SpeculativeConfig(), description="Speculative decoding.")
    fleet: FleetConfig = Field(FleetConfig(), description="`dflash-serve fleet`: replicas behind a router.")
    learning: LearningConfig = Field(LearningConfig(), description="A drafter that learns the traffic it serves.")
    sglang_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Other `sglang serve` arguments by their flag name without dashes "
                    "(e.g. chunked_prefill_size: 512, log_requests: true); validated against SGLang's parser, "
                    "so typos fail at load time.")


    @model_validator(mode="after")
    def _learning_needs(self):
        lr = self.learning
        if not lr.enabled:
            return self
        if lr.store_dir is None:
            raise ValueError("learning: store_dir: required when learning is enabled (a directory for the store)")
        if self.speculative.algorithm == "none":
            raise ValueError("learning: enabled needs a DFlash drafter (speculative.algorithm dflash or "
                             "dflash_adaptive)")
        if self.server.admin_api_key_env is None:
            raise ValueError("learning: enabled needs server.admin_api_key_env: the hot swap is an admin route")
        return self


def _format(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = first["msg"].removeprefix("Value error, ")
    head, sep, rest = msg.partition(": ")
    if sep and head.isidentifier():  # a nested validator naming its field ("hysteresis: must be ...")
        loc, msg = (head if loc == "(top level)" else f"{loc}.{head}"), rest
    if first["type"] == "extra_forbidden":
        msg = "unknown key (check the spelling; see the config reference in docs/CONFIG.md)"
    elif first["type"] == "missing":
        msg = "required field is missing"
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{loc}: {msg}{more}"


def parse_config(data: Any, base: Path = Path(".")) -> ServeConfig:
    if not isinstance(data, dict):
        raise ConfigError("(top level): expected a mapping of sections (model, server, speculative, fleet, sglang_args)")
    try:
        return ServeConfig.model_validate(data, context={"base": base})
    except ValidationError as e:
        raise ConfigError(_format(e)) from None


def load_config(path: str | Path) -> ServeConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {getattr(e, 'problem', e)}") from None
    return parse_config(data, base=path.resolve().parent)
