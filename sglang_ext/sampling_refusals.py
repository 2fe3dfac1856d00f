"""Which sampling parameters DFlash cannot serve as plain decoding would: the one rule, for a request's effective
parameters (patches/request_validation.py, after SGLang merged the operator's defaults) and for the defaults
themselves at start-up (service/preflight.py: the operator's `preferred_sampling_params`, the model's
generation_config.json).

Why each: DFlash's rejection sampler draws its own coins, so a `sampling_seed` at temperature > 0 would not
reproduce the seeded samples; under the overlap scheduler the next step launches before this step's tokens reach
the penalizers, so penalties and `min_new_tokens` would see stale counts (patches/verify_sampling.py makes every
other sampling parameter lossless).

Pure module: no sglang, no torch.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DFLASH_FAMILY = ("DFLASH", "DFLASH_ADAPTIVE")
PENALTIES = (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0),
             ("min_new_tokens", 0))
OVERLAP_FIX = "set sglang_args.disable_overlap_schedule: true"


@dataclass(frozen=True)
class Lossy:
    """A parameter DFlash would serve differently: `why` completes "<param> ...", `server_fix` is what the
    operator can change instead of dropping the parameter (None: nothing)."""

    param: str
    why: str
    server_fix: str | None = None


def is_dflash(algorithm: Any) -> bool:
    return str(algorithm or "").upper() in DFLASH_FAMILY


def lossy_sampling(params: Mapping[str, Any], overlap: bool) -> Lossy | None:
    """The first parameter of `params` (SGLang's sampling-parameter names) DFlash would not serve losslessly;
    `overlap`: the server runs SGLang's overlap scheduler."""
    temperature = params.get("temperature", 1.0)
    if params.get("sampling_seed") is not None and (temperature is None or temperature > 0):
        return Lossy("sampling_seed", "is not supported with DFlash speculative decoding at temperature > 0 (its "
                                      "rejection sampler would not reproduce the seeded samples)")
    if overlap:
        for name, neutral in PENALTIES:
            value = params.get(name)
            if value is not None and value != neutral:
                return Lossy(name, "is not served losslessly by DFlash under the overlap scheduler", OVERLAP_FIX)
    return None
