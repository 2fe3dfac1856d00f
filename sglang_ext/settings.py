"""What the DFLASH_ADAPTIVE worker is configured with, and how it travels to the scheduler process.

Why an environment variable: SGLang starts the scheduler in its own process from its own server args, which have
no field for a plugin's settings (``--speculative-adaptive-config`` is EAGLE's and is refused for other
algorithms). The launcher serialises the validated settings into ``DFLASH_SERVE_ADAPTIVE`` (JSON); spawned
processes inherit it. Running ``sglang serve`` by hand works too: unset means the defaults.

Pure module: no sglang, no torch.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_ext.controller.config import ControllerConfig

ENV_VAR = "DFLASH_SERVE_ADAPTIVE"


@dataclass(frozen=True)
class AdaptiveSettings:
    """controller: the block-size controller's settings.
    cost_profile: JSON cost profile seeding the step-cost table (a measured table, or a roofline description; see
        controller/cost_model.py); None = the packaged H200 + Qwen3-8B roofline (right shape, wrong scale off it).
    learn_costs: refine the cost table online from measured step times (off = the profile is the truth: for
        operators who profiled offline, and for tests that need a known cost landscape).
    """

    controller: ControllerConfig = field(default_factory=ControllerConfig)
    cost_profile: str | None = None
    learn_costs: bool = True

    def to_json(self) -> str:
        return json.dumps({"controller": self.controller.to_dict(), "cost_profile": self.cost_profile,
                           "learn_costs": self.learn_costs})

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "AdaptiveSettings":
        unknown = sorted(set(d) - {"controller", "cost_profile", "learn_costs"})
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown adaptive setting")
        profile = d.get("cost_profile")
        if profile is not None:
            if not isinstance(profile, str) or not Path(profile).is_file():
                raise ValueError(f"cost_profile: {profile!r} is not a readable file")
        learn = d.get("learn_costs", True)
        if not isinstance(learn, bool):
            raise ValueError(f"learn_costs: must be true or false, got {learn!r}")
        return cls(ControllerConfig.from_dict(d.get("controller") or {}), profile, learn)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "AdaptiveSettings":
        raw = environ.get(ENV_VAR)
        if not raw:
            return cls()
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{ENV_VAR}: not valid JSON ({e})") from None
        if not isinstance(data, Mapping):
            raise ValueError(f"{ENV_VAR}: expected a JSON object")
        return cls.from_mapping(data)
