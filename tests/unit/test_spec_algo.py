"""DFLASH_ADAPTIVE, registered from the plugin, takes every code path builtin DFLASH takes."""
from __future__ import annotations

from tests.conftest import child_result

PROBE = r"""
import json
import sglang_ext.plugin as plugin
plugin.register()
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm as S
ours, builtin = S.from_string("DFLASH_ADAPTIVE"), S.DFLASH
names = sorted(n for n in vars(S) if n.startswith(("is_", "supports_", "need_", "carries_")) and callable(getattr(S, n)))
answers = {n: [getattr(ours, n)(), getattr(builtin, n)()] for n in names}
print("RESULT" + json.dumps({"answers": answers, "has_future_map": callable(getattr(ours, "create_future_map", None)),
                             "has_platform_cls": ours.get_platform_worker_cls() is None,
                             "disagg_borrowed": type(ours).build_disagg_draft_input is vars(S)["build_disagg_draft_input"]}))
"""


def test_answers_every_predicate_as_builtin_dflash():
    out = child_result("-c", PROBE)
    differing = {n: a for n, a in out["answers"].items() if a[0] != a[1] and n not in ("is_some", "is_speculative")}
    assert differing == {}
    assert out["answers"]["is_dflash"] == [True, True] and out["answers"]["is_dflash_family"] == [True, True]
    assert out["has_future_map"] and out["has_platform_cls"]
    assert out["disagg_borrowed"]  # CustomSpecAlgo's stub returns None: DFlash disaggregation needs the enum's


LATE = r"""
import json
import sglang.srt.managers.scheduler_components.metrics_reporter as mr  # imported before the plugin registers,
import sglang.srt.arg_groups.model_override_base as mob                 # as in SGLang's scheduler process
import sglang_ext.plugin as plugin
plugin.register()
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm as S
ours = S.from_string("DFLASH_ADAPTIVE")
print("RESULT" + json.dumps({"snapshot": ours in mr._SPEC_DECODE_SNAPSHOT_ALGORITHMS,
                             "topk_one": mob._forces_eagle_topk_one("DFLASH_ADAPTIVE")}))
"""


def test_registers_and_patches_when_sglang_modules_are_already_imported():
    assert child_result("-c", LATE) == {"snapshot": True, "topk_one": True}
