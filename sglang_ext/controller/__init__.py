"""Adaptive DFlash block-size controller: pure Python + numpy (imports neither sglang nor torch).

Public API (used by the SGLang worker):
    ControllerConfig     settings, validated (config.py)
    CostModel            step-time table T(batch bucket, b), seeded + learned online (cost_model.py)
    BlockSizeController  decide() / observe_step() / observe_step_time() / finish() (policy.py)
    Decision             what decide() returns
    AcceptanceStats      per-position acceptance estimates (acceptance.py)
The simulator and its workloads live in harness/ (dev only); roofline.py is here because CostModel seeds from it.
"""

from .acceptance import AcceptanceStats
from .config import ControllerConfig
from .cost_model import CostModel
from .policy import BlockSizeController, Decision

__all__ = ["AcceptanceStats", "BlockSizeController", "ControllerConfig", "CostModel", "Decision"]
