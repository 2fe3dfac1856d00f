"""The one form an acceptance observation takes, and the per-position counts a set of them adds.

Why: a verify at width b sees draft positions < b only (censored), a hindsight comparison sees the full block, and a
request that finishes leaves blocks seen only in part; one form for all three lets AcceptanceStats add them alike,
and turning a batch of them into counts without a Python loop over observations keeps the step's feedback cheap.

Contract:
  * An observation is ``(slot, accepted_len, tried)``: positions 1..min(accepted_len, tried) were tried and accepted;
    position accepted_len + 1 was tried and rejected iff accepted_len < tried; positions beyond are unobserved. A
    verify at width b is ``tried = b - 1``, a hindsight comparison ``tried = J`` (hindsight.py), a flushed partial
    block ``accepted_len = tried = tokens seen``. Callers must not feed the same event twice (see request_state.py).
  * ``position_counts(groups, n_groups, accepted, tried, J)`` -> (A, N), each [n_groups, J]: per group (``groups``
    numbers each observation's group 0..n_groups-1), how many of its observations accepted / tried position j
    (column j - 1). ``tried`` beyond J counts as J.

Invariants: 0 <= A <= N elementwise; A and N are non-increasing along positions; pure numpy.
"""

from __future__ import annotations

import numpy as np


def position_counts(groups: np.ndarray, n_groups: int, accepted: np.ndarray, tried: np.ndarray,
                    J: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-group position counts [n_groups, J] (accepted, tried) of a set of observations (module contract).

    Each observation is a step function over positions (accepted: j <= acc; tried: j <= min(acc + 1, tried)), so a
    histogram of the two limits per group and a reverse cumulative sum give the counts without any per-observation
    loop."""
    J1 = J + 1
    tr = np.minimum(np.asarray(tried, dtype=np.int64), J)
    acc = np.minimum(np.asarray(accepted, dtype=np.int64), tr)
    lim = np.minimum(acc + 1, tr)
    base = groups * J1
    ha = np.bincount(base + acc, minlength=n_groups * J1).reshape(n_groups, J1)
    hn = np.bincount(base + lim, minlength=n_groups * J1).reshape(n_groups, J1)
    # count of observations with limit >= j, for j = 1..J
    A = np.cumsum(ha[:, ::-1], axis=1)[:, ::-1][:, 1:]
    N = np.cumsum(hn[:, ::-1], axis=1)[:, ::-1][:, 1:]
    return A, N
