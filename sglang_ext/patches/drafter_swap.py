"""Tell the speculative worker its drafter's weights were replaced, and refuse a drafter that would break it (all
devices).

Patches (0.5.23): `managers/scheduler_components/weight_updater.SchedulerWeightUpdaterManager.
begin_weight_update`, `update_weights_from_tensor` and `end_weight_update`; `model_executor/
model_runner_components/weight_updater.WeightUpdater.update_weights_from_tensor`. Why, three times:
  * a successful update with `selector` "draft" or "all" reloads the draft model's parameters in place, but nothing
    tells the worker, and two things it holds were derived from the old drafter: upstream DFlashWorkerV2's fused
    context-KV helper (GPU) keeps stacked *copies* of the draft's K/V projection and k_norm weights
    (`kernels/ops/speculative/fused_kv_materialize.py`), so the draft context would still be written with the old
    weights; and the adaptive controller's acceptance priors describe the old drafter. When the client ends a
    session in which draft chunks loaded (`end_weight_update`), this calls `draft_worker.drafter_swapped(version)`
    where the worker has it, once, with the version the chunks named (AdaptiveDFlashWorker: rebuild the helper,
    reset the priors, count the swap on /metrics) -- not per chunk: a refused or abandoned push (below) was never a
    swap to the worker, and its helper still holds the weights that serve;
  * upstream loads whatever it is sent: a weight with a NaN or an Inf is loaded (the drafter then proposes garbage,
    or NaN draft probabilities reach the sampler); a weight of the wrong shape is narrowed silently by the stacked
    loaders (a larger q/k/v projection) or raises out of the load -- out of the scheduler's request handler, which
    ends the server -- after the chunks before it were loaded. Here a runner refuses tensors that are not all finite
    or not shaped as the served checkpoint's tensors of the same name (its safetensors headers) before loading any,
    and answers a load that raised with a failure; a refused draft update restores the draft weights the session
    began with (a copy taken at `begin_weight_update`, on the host: the draft's own parameters, not those it shares
    with the target), so a refused push -- whichever chunk -- leaves the drafter that served before it, its version
    and swap count unchanged;
  * upstream keeps whatever a session loaded, and a session whose client is gone (a learner killed mid-push) is
    never ended: the chunks loaded so far serve, half a drafter. The HTTP process ends such a session itself
    (patches/pause_lease.py) with the rid names.ROLLBACK_RID, and then the draft weights the session began with are
    restored before it ends: an abandoned push leaves no part of its drafter loaded.
Retired by: upstream re-deriving the fused helper after a draft weight update, offering a post-update hook to the
speculative worker, and validating a weight update (finite, shapes) before loading it.
"""
from __future__ import annotations

import logging
from types import ModuleType

from sglang_ext.names import ROLLBACK_RID
from sglang_ext.patches.wrap import when_imported, wrap

logger = logging.getLogger(__name__)
UPDATER = "sglang.srt.managers.scheduler_components.weight_updater"
RUNNER_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater"
_SNAPSHOTS: dict[int, list] = {}  # id(manager) -> [(parameter, host copy)]: the manager has __slots__
# id(manager) -> the version the open session's loaded draft chunks named (None: none named), present once a chunk
# loaded and until the session ends or a refusal restores the weights it began with: what the worker is told at the end
_UNTOLD: dict[int, str | None] = {}


_NOTHING = object()


def _touches_draft(selector) -> bool:
    return selector in ("draft", "all")


def _draft_params(manager) -> list:
    """The draft models' own parameters (those it shares with the target -- embeddings, LM head -- excluded)."""
    shared = set()
    target = getattr(getattr(manager.tp_worker, "model_runner", None), "model", None)
    if target is not None:
        shared = {p.data_ptr() for p in target.parameters()}
    out = []
    for _, runner in manager._select_runners("draft"):
        out += [p for p in runner.model.parameters() if p.data_ptr() not in shared]
    return out


def _snapshot(manager) -> None:
    _SNAPSHOTS[id(manager)] = [(p, p.detach().to("cpu", copy=True)) for p in _draft_params(manager)]


def _restore(manager) -> bool:
    saved = _SNAPSHOTS.get(id(manager))
    if not saved:
        return False
    import torch

    with torch.no_grad():
        for p, copy in saved:
            p.copy_(copy.to(p.device))
    return True


def non_finite(named_tensors) -> list[str]:
    """Names of the floating-point tensors with a NaN or an Inf."""
    import torch

    return [name for name, t in named_tensors
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())]


_SHAPES: dict[str, dict[str, tuple]] = {}


def checkpoint_shapes(path) -> dict[str, tuple]:
    """Name -> shape of every tensor in the safetensors files of the checkpoint directory `path` (headers only;
    empty when it is not a local directory of safetensors)."""
    key = str(path)
    if key not in _SHAPES:
        from pathlib import Path

        from safetensors import safe_open

        shapes: dict[str, tuple] = {}
        try:
            files = sorted(Path(key).glob("*.safetensors"))
        except (OSError, ValueError):
            files = []
        for f in files:
            with safe_open(str(f), "pt") as h:
                for name in h.keys():
                    shapes[name] = tuple(h.get_slice(name).get_shape())
        _SHAPES[key] = shapes
    return _SHAPES[key]


def wrong_shapes(named_tensors, shapes: dict[str, tuple]) -> list[str]:
    """The tensors named as a checkpoint tensor but shaped otherwise (upstream's stacked loaders narrow a larger
    tensor silently). Names the checkpoint lacks are left to the loader."""
    import torch

    return [f"{name} {tuple(t.shape)}, the checkpoint's {shapes[name]}" for name, t in named_tensors
            if isinstance(t, torch.Tensor) and name in shapes and tuple(t.shape) != shapes[name]]


def _patch_runner(runner_updater: ModuleType) -> None:
    """A runner's load refuses tensors that are not all finite, or not shaped as the served checkpoint's tensors of
    the same name, before loading anything, and answers a load that raised with a failure (upstream lets it raise
    out of the scheduler's request handler)."""
    def make(original):
        def update_weights_from_tensor(self, named_tensors, load_format=None):
            bad = non_finite(named_tensors) if load_format is None else []
            if bad:
                return False, f"refused: non-finite values (NaN or Inf) in {', '.join(bad[:4])}"
            path = getattr(getattr(self, "model_config", None), "model_path", None)
            shaped = wrong_shapes(named_tensors, checkpoint_shapes(path)) if load_format is None and path else []
            if shaped:
                return False, f"refused: wrong shape: {'; '.join(shaped[:4])}"
            try:
                return original(self, named_tensors, load_format)
            except Exception as e:  # e.g. a weight of the wrong shape; the tensors before it were loaded
                return False, f"refused: the weights failed to load ({type(e).__name__}: {e})"

        return update_weights_from_tensor

    wrap(runner_updater.WeightUpdater, "update_weights_from_tensor", make)


def _patch(updater: ModuleType) -> None:
    def make_begin(original):
        def begin_weight_update(self, recv_req):
            out = original(self, recv_req)
            if out.success:  # a refused begin leaves the open session's copy alone
                _SNAPSHOTS.pop(id(self), None)
                _UNTOLD.pop(id(self), None)
                if _touches_draft(recv_req.selector):
                    _snapshot(self)
            return out

        return begin_weight_update

    def make_end(original):
        def end_weight_update(self, recv_req):
            rollback = getattr(recv_req, "rid", None) == ROLLBACK_RID
            selector = getattr(getattr(self, "_session", None), "selector", None)
            restored = rollback and _restore(self)
            _SNAPSHOTS.pop(id(self), None)
            untold = _UNTOLD.pop(id(self), _NOTHING)
            out = original(self, recv_req)
            if rollback and selector is not None:
                kept = " (the target's weights it loaded stay: no copy of them is kept)" if selector != "draft" else ""
                logger.error("dflash-serve: weight-update session (%s) ended for a client that is gone: %s%s",
                             selector, "draft weights restored to those it began with" if restored
                             else "no draft weights to restore", kept)
            elif out.success and untold is not _NOTHING:
                hook = getattr(getattr(self, "draft_worker", None), "drafter_swapped", None)
                if hook is not None:
                    hook(untold)
            return out

        return end_weight_update

    def make_update(original):
        def update_weights_from_tensor(self, recv_req):
            out = original(self, recv_req)
            if not _touches_draft(recv_req.selector):
                return out
            if not out.success and _restore(self):
                import msgspec

                _UNTOLD.pop(id(self), None)  # the draft is the session's first again: nothing to tell
                out = msgspec.structs.replace(
                    out, message=f"{out.message}; the draft weights the update began with were restored")
                logger.error("draft weight update refused: %s", out.message)
            elif out.success:
                named = recv_req.weight_version
                _UNTOLD[id(self)] = named if named is not None else _UNTOLD.get(id(self))
            return out

        return update_weights_from_tensor

    wrap(updater.SchedulerWeightUpdaterManager, "begin_weight_update", make_begin)
    wrap(updater.SchedulerWeightUpdaterManager, "end_weight_update", make_end)
    wrap(updater.SchedulerWeightUpdaterManager, "update_weights_from_tensor", make_update)


def install() -> None:
    when_imported(RUNNER_UPDATER, _patch_runner)
    when_imported(UPDATER, _patch)
