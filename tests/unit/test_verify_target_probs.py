"""Sampled verify draws from the distribution plain decoding's sampler draws from, by the fast paths too.

`verify_rows.target_probs_torch` gives every verify row SGLang's pytorch sampler's distribution (the CPU backend):
a softmax alone when no request sets top-k/top-p/min_p (the sampler's simple case), the ``max_top_k`` largest when
every request sets top-k, a full sort otherwise. The reference is SGLang's own sampler function, asked for the
filtered weights it samples from.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

# SGLang imports on this machine only with DFLASH_SERVE_CPU=1 set at interpreter start: the cases run in a child.
CHILD = r"""
import json, torch
from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch
from sglang_ext.verify_rows import target_probs_torch

V = 512


def sampler_distribution(logits, top_ks, top_ps, min_ps):
    # what SGLang's pytorch sampler samples from, as a dense renormalised [rows, V] distribution
    probs = torch.softmax(logits, dim=-1)
    rows = logits.shape[0]
    _, weights, idx, _ = top_k_top_p_min_p_sampling_from_probs_torch(
        probs.clone(), top_ks, top_ps, min_ps, bool((min_ps > 0).any()), None, torch.zeros(rows, dtype=torch.int64),
        return_filtered_probs=True)
    dense = torch.zeros_like(probs).scatter_(1, idx.long(), weights)
    return dense / dense.sum(dim=-1, keepdim=True)


CASES = {
    "simple": (lambda r: torch.full((r,), V), lambda r: torch.ones(r), lambda r: torch.zeros(r)),
    "top_k everywhere": (lambda r: torch.randint(1, 40, (r,)), lambda r: torch.ones(r), lambda r: torch.zeros(r)),
    "top_k and top_p": (lambda r: torch.randint(1, 40, (r,)), lambda r: torch.rand(r) * 0.9 + 0.05,
                        lambda r: torch.zeros(r)),
    "top_p some rows": (lambda r: torch.full((r,), V), lambda r: torch.where(torch.rand(r) < 0.5, 0.7, 1.0),
                        lambda r: torch.zeros(r)),
    "min_p": (lambda r: torch.full((r,), V), lambda r: torch.ones(r), lambda r: torch.rand(r) * 0.3),
}
out = {}
for name, (fk, fp, fm) in CASES.items():
    torch.manual_seed(0)
    rows = 48
    logits = torch.randn(rows, V) * 3
    tk, tp, mp = fk(rows), fp(rows), fm(rows)
    need_min_p = bool((mp > 0).any())
    # the flags as SamplingBatchInfo sets them: need_*_sampling is True as soon as one request cuts
    simple = bool((tk == V).all() and (tp == 1).all()) and not need_min_p
    max_top_k = int(tk.max()) if bool((tk < V).all()) else None
    got = target_probs_torch(logits, tk, tp, mp if need_min_p else None, simple=simple, max_top_k=max_top_k)
    full = target_probs_torch(logits, tk, tp, mp if need_min_p else None)
    want = sampler_distribution(logits, tk, tp, mp)
    out[name] = {"fast_vs_sampler": float((got - want).abs().max()), "full_vs_sampler": float((full - want).abs().max()),
                 "support": int((want > 0).sum())}
# a batch with one top-k request must not be served the softmax: the flag is what keeps it exact
torch.manual_seed(1)
logits = torch.randn(4, V)
tk = torch.tensor([V, V, 5, V])
cut = target_probs_torch(logits, tk, torch.ones(4), None)
out["one_row_cuts"] = {"support_row2": int((cut[2] > 0).sum()),
                       "simple_differs": float((cut - target_probs_torch(logits, tk, torch.ones(4), None,
                                                                        simple=True)).abs().max())}
# a batch mixing kinds of rows (greedy: top-k 1; uncut; top-p; top-k and min_p), as a ragged step or a mixed batch
# hands it, with the batch's flags all set: each row still gets its own request's distribution
from types import SimpleNamespace
from sglang_ext.verify_rows import sampler_probs
torch.manual_seed(2)
rows = 48
logits = torch.randn(rows, V) * 3
kind = torch.arange(rows) % 4
tk = torch.where(kind == 0, 1, torch.where(kind == 3, torch.randint(2, 40, (rows,)), V))
tp = torch.where(kind == 2, 0.8, 1.0)
mp = torch.where(kind == 3, 0.05, 0.0)
temps = torch.rand(rows, 1) + 0.5
si = SimpleNamespace(temperatures=temps, top_ks=tk, top_ps=tp, min_ps=mp, need_min_p_sampling=True,
                     need_top_p_sampling=True, need_top_k_sampling=True, max_top_k=None)
got = sampler_probs(logits, si, lambda t: t)
want = sampler_distribution(logits / temps, tk, tp, mp)
out["mixed kinds"] = {"vs_sampler": float((got - want).abs().max()),
                      "greedy_one_hot": bool((got[kind == 0].max(dim=-1).values == 1).all()),
                      "uncut_support": int((got[kind == 1] > 0).sum())}
print(json.dumps(out))
"""


def _run() -> dict:
    env = dict(os.environ, DFLASH_SERVE_CPU="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_verify_rows_sample_the_plain_samplers_distribution():
    out = _run()
    for case in ("simple", "top_k everywhere", "top_k and top_p", "top_p some rows", "min_p"):
        assert out[case]["fast_vs_sampler"] < 1e-6, (case, out[case])
        assert out[case]["full_vs_sampler"] < 1e-6, (case, out[case])
    # the cases cut: the comparison is not between two softmaxes
    assert out["top_k everywhere"]["support"] < 48 * 40 and out["min_p"]["support"] < 48 * 512
    assert out["one_row_cuts"]["support_row2"] == 5 and out["one_row_cuts"]["simple_differs"] > 0.01


def test_a_batch_mixing_greedy_and_sampled_rows_gives_each_row_its_requests_distribution():
    """sampler_probs on CPU computes greedy rows (one-hot), uncut rows (softmax) and cut rows (sorted) apart: each
    still equals what SGLang's sampler draws from for its request."""
    mixed = _run()["mixed kinds"]
    assert mixed["vs_sampler"] < 1e-6 and mixed["greedy_one_hot"], mixed
    assert mixed["uncut_support"] == 12 * 512  # the uncut rows keep the whole vocabulary
