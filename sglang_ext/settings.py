"""What the plugin is configured with, and how it travels from the launcher to SGLang's processes.

Why environment variables: SGLang starts the scheduler in its own process from its own server args, which have no
field for a plugin's settings (``--speculative-adaptive-config`` is EAGLE's and is refused for other algorithms).

Contract (one settings path):
  * built and validated once, in the launcher's process: service/config.py turns the YAML into these records
    (the YAML schema of ``speculative.adaptive`` is derived from ``ControllerConfig``'s fields and defaults) and
    service/preflight.py checks them against the drafter (``ControllerConfig.check_against_max_block``);
  * serialised with ``to_json`` into the variables named in names.py; read once, in the process that uses them
    (``adaptive_settings``: the worker at start-up and the KV sizing share one read; ``HttpSettings.from_env``:
    the HTTP guard at import). Unset means the defaults, so a hand-run
    ``sglang serve`` works too.
  * errors name the variable or the field (``hysteresis: must be ...``).

Pure module: no sglang, no torch.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sglang_ext import names as env
from sglang_ext.controller.config import ControllerConfig

DEFAULT_MAX_REQUEST_BYTES = 2 * 1024 * 1024
DEFAULT_PAUSE_LEASE_SECONDS = 30.0


def _read_json(environ: Mapping[str, str], name: str) -> Mapping[str, Any] | None:
    raw = environ.get(name)
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: not valid JSON ({e})") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"{name}: expected a JSON object")
    return data


@dataclass(frozen=True)
class AdaptiveSettings:
    """The DFLASH_ADAPTIVE worker's settings.

    controller: the block-size controller's settings.
    cost_profile: JSON cost profile seeding the step-cost table (a measured table, or a roofline description; see
        controller/cost_model.py); None = the packaged H200 + Qwen3-8B roofline (right shape, wrong scale off it).
        The preflight has loaded it once; the worker loads it for real.
    learn_costs: refine the cost table online from measured step times (off = the profile is the truth: for
        operators who profiled offline, and for tests that need a known cost landscape).
    DDTree verification is a controller candidate: a width above the drafter's block (controller/config.py).
    """

    controller: ControllerConfig = field(default_factory=ControllerConfig)
    cost_profile: str | None = None
    learn_costs: bool = True

    def controller_in_use(self) -> ControllerConfig:
        """The controller's config as the worker runs it: without cost learning, exploring would only measure
        cells nothing learns from, so it is off."""
        if self.learn_costs:
            return self.controller
        return dataclasses.replace(self.controller, explore_margin=0.0)

    def to_json(self) -> str:
        return json.dumps({"controller": self.controller.to_dict(), "cost_profile": self.cost_profile,
                           "learn_costs": self.learn_costs})

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "AdaptiveSettings":
        unknown = sorted(set(d) - {"controller", "cost_profile", "learn_costs"})
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown adaptive setting")
        profile = d.get("cost_profile")
        if profile is not None and not isinstance(profile, str):
            raise ValueError(f"cost_profile: must be a file path, got {profile!r}")
        learn = d.get("learn_costs", True)
        if not isinstance(learn, bool):
            raise ValueError(f"learn_costs: must be true or false, got {learn!r}")
        return cls(ControllerConfig.from_dict(d.get("controller") or {}), profile, learn)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "AdaptiveSettings":
        data = _read_json(environ, env.ADAPTIVE)
        return cls() if data is None else cls.from_mapping(data)


@functools.cache
def adaptive_settings() -> AdaptiveSettings:
    """This process's adaptive settings: the environment is read at the first call, and every reader shares it."""
    return AdaptiveSettings.from_env()


@dataclass(frozen=True)
class HttpSettings:
    """The HTTP guard's settings (patches/http_guard.py); their presence activates it (only under dflash-serve).

    max_request_bytes: largest request body (413 above it); None = no limit.
    check_model: answer 404 to a `model` the server does not serve.
    scheduler_stopping_routes: open the admin routes that can stop the scheduler to the admin key (403 otherwise).
    pause_lease_seconds: a pause or weight-update session whose client makes no call for this long is ended by the
        server (patches/pause_lease.py); None = held until the client ends it.
    """

    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES
    check_model: bool = True
    scheduler_stopping_routes: bool = False
    pause_lease_seconds: float | None = DEFAULT_PAUSE_LEASE_SECONDS

    def to_json(self) -> str:
        return json.dumps({"max_request_bytes": self.max_request_bytes, "check_model": self.check_model,
                           "scheduler_stopping_routes": self.scheduler_stopping_routes,
                           "pause_lease_seconds": self.pause_lease_seconds})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "HttpSettings | None":
        d = _read_json(environ, env.HTTP)
        if d is None:
            return None
        limit = d.get("max_request_bytes", DEFAULT_MAX_REQUEST_BYTES)
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0):
            raise ValueError(f"{env.HTTP}: max_request_bytes must be a positive integer or null, got {limit!r}")
        lease = d.get("pause_lease_seconds", DEFAULT_PAUSE_LEASE_SECONDS)
        if lease is not None and (not isinstance(lease, (int, float)) or isinstance(lease, bool) or not lease > 0):
            raise ValueError(f"{env.HTTP}: pause_lease_seconds must be a positive number or null, got {lease!r}")
        return cls(limit, bool(d.get("check_model", True)), d.get("scheduler_stopping_routes") is True,
                   None if lease is None else float(lease))


CAPTURE_OPT_OUT_KEY = "dflash_capture"
"""The per-request opt-out: ``custom_params: {"dflash_capture": false}`` keeps a request out of the store."""


@dataclass(frozen=True)
class CaptureSettings:
    """What the scheduler keeps of served traffic for the drafter's learning (capture.py; docs/LEARNING.md).

    store_dir: the store's directory (append-only JSONL segments of token ids, nothing else).
    max_store_bytes: the store's size limit: the oldest segments are deleted past it.
    max_age_seconds: segments older than this are deleted.
    segment_bytes: a segment is closed (and becomes deletable) at this size.
    queue_max: finished requests waiting for the writer thread; more are dropped (counted), never waited for.
    """

    store_dir: str
    max_store_bytes: int = 256 * 1024 * 1024
    max_age_seconds: float = 7 * 24 * 3600.0
    segment_bytes: int = 4 * 1024 * 1024
    queue_max: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_store_bytes", "segment_bytes", "queue_max"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        if not self.max_age_seconds > 0:
            raise ValueError(f"max_age_seconds: must be > 0, got {self.max_age_seconds!r}")
        if not self.store_dir:
            raise ValueError("store_dir: must name a directory")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "CaptureSettings | None":
        d = _read_json(environ, env.CAPTURE)
        if d is None:
            return None
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"{env.CAPTURE}: {unknown[0]}: unknown capture setting")
        try:
            return cls(**d)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{env.CAPTURE}: {e}") from None
