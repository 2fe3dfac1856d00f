"""sglang_ext/patches/drafter_swap.py's guard, without a server: a runner refuses non-finite tensors before loading
and answers a load that raised with a failure; a refused draft update restores the draft's own weights (not those it
shares with the target) from the copy taken when the update began. The served path: tests/integration/test_learning.py."""
from __future__ import annotations

import pytest
import torch

from sglang_ext.patches import drafter_swap


class _Runner:
    def __init__(self, model):
        self.model = model


class _Manager:
    __slots__ = ("tp_worker", "draft")  # like upstream's: no attribute can be added

    def __init__(self, target, draft):
        self.tp_worker = type("W", (), {"model_runner": _Runner(target)})()
        self.draft = _Runner(draft)

    def _select_runners(self, selector):
        return [("draft", self.draft)]


def _pair():
    target = torch.nn.Embedding(8, 4)
    draft = torch.nn.Sequential(torch.nn.Linear(4, 4))
    draft.embed = target  # shared with the target: never copied, never restored
    return target, draft


def test_non_finite_names_the_tensors_with_a_nan_or_an_inf():
    named = [("a", torch.tensor([1.0, float("nan")])), ("b", torch.ones(2, dtype=torch.bfloat16)),
             ("c", torch.tensor([1, 2])), ("d", torch.tensor([float("-inf")], dtype=torch.bfloat16))]
    assert drafter_swap.non_finite(named) == ["a", "d"]


def test_a_refused_update_restores_the_drafts_own_weights():
    target, draft = _pair()
    manager = _Manager(target, draft)
    own = [p for p in draft.parameters() if p.data_ptr() not in {q.data_ptr() for q in target.parameters()}]
    assert [p.data_ptr() for p in drafter_swap._draft_params(manager)] == [p.data_ptr() for p in own]
    before = [p.detach().clone() for p in draft.parameters()]
    drafter_swap._snapshot(manager)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(1.0)  # a partial load, and a change to the shared embedding the snapshot must not undo
    assert drafter_swap._restore(manager)
    after = list(draft.parameters())
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])  # the Linear: restored
    assert torch.equal(target.weight, before[2] + 1.0)  # the target's embedding: left alone
    drafter_swap._SNAPSHOTS.pop(id(manager))
    assert not drafter_swap._restore(manager)  # no session copy: nothing to restore


@pytest.mark.parametrize("fault", ["nan", "wrong_shape"])
def test_a_runner_refuses_a_faulty_update_and_survives_a_failed_load(fault):
    class Updater:
        loaded = []

        def update_weights_from_tensor(self, named_tensors, load_format=None):
            for name, t in named_tensors:
                if t.shape != (2,):
                    raise RuntimeError(f"size mismatch for {name}")
                self.loaded.append(name)
            return True, "Success"

    module = type("M", (), {"WeightUpdater": Updater})
    drafter_swap._patch_runner(module)
    bad = torch.tensor([float("nan"), 1.0]) if fault == "nan" else torch.ones(3)
    ok, message = Updater().update_weights_from_tensor([("w0", torch.ones(2)), ("w1", bad)])
    assert not ok and message.startswith("refused:")
    assert Updater.loaded == ([] if fault == "nan" else ["w0"])  # NaN: nothing loaded; the shape: found mid-load


def test_a_tensor_shaped_unlike_the_checkpoints_is_named(tmp_path):
    from safetensors.torch import save_file

    save_file({"a.weight": torch.zeros(4, 2), "b.weight": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    shapes = drafter_swap.checkpoint_shapes(tmp_path)
    assert shapes == {"a.weight": (4, 2), "b.weight": (3,)}
    named = [("a.weight", torch.zeros(5, 2)), ("b.weight", torch.zeros(3)), ("extra", torch.zeros(1))]
    assert drafter_swap.wrong_shapes(named, shapes) == ["a.weight (5, 2), the checkpoint's (4, 2)"]
    assert drafter_swap.checkpoint_shapes(tmp_path / "missing") == {}
