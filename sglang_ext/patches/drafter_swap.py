"""Tell the speculative worker its drafter's weights were replaced (all devices).

Patches (0.5.23): `managers/scheduler_components/weight_updater.SchedulerWeightUpdaterManager.
update_weights_from_tensor`. Why: a successful update with `selector` "draft" or "all" reloads the draft model's
parameters in place, but nothing tells the worker, and two things it holds were derived from the old drafter:
upstream DFlashWorkerV2's fused context-KV helper (GPU) keeps stacked *copies* of the draft's K/V projection and
k_norm weights (`kernels/ops/speculative/fused_kv_materialize.py`), so the draft context would still be written
with the old weights; and the adaptive controller's acceptance priors describe the old drafter. After the update
this calls `draft_worker.drafter_swapped(weight_version)` where the worker has it (AdaptiveDFlashWorker: rebuild the
helper, reset the priors, count the swap on /metrics). Retired by: upstream re-deriving the fused helper after a
draft weight update and offering a post-update hook to the speculative worker.
"""
from __future__ import annotations

import logging
from types import ModuleType

from sglang_ext.patches.wrap import when_imported, wrap

logger = logging.getLogger(__name__)
UPDATER = "sglang.srt.managers.scheduler_components.weight_updater"


def _patch(updater: ModuleType) -> None:
    def make(original):
        def update_weights_from_tensor(self, recv_req):
            out = original(self, recv_req)
            worker = getattr(self, "draft_worker", None)
            hook = getattr(worker, "drafter_swapped", None)
            if out.success and recv_req.selector in ("draft", "all") and hook is not None:
                hook(recv_req.weight_version)
            return out

        return update_weights_from_tensor

    wrap(updater.SchedulerWeightUpdaterManager, "update_weights_from_tensor", make)


def install() -> None:
    when_imported(UPDATER, _patch)
