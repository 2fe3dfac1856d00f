"""Sampled outputs under DFlash have the target's distribution: the joint of the first three generated tokens,
speculative vs plain decoding, at temperature 1 with and without top-k/top-p, min_p and penalties.

Statistic, sample size and power: tests/sampling_stats.py (each position coarsened to its 4 most frequent tokens +
other, Pearson chi-square homogeneity on the coarsened triples, N_PER_ARM = 800 requests per arm, ALPHA = 0.001);
tests/unit/test_sampling_power.py and benchmarks/sampling_power.py compute the power against two plausible wrong
rules -- resampling without excluding the rejected token, or a bonus drawn from the wrong row after a full accept:
on the bundled target's own conditionals after this prompt, 100 of 100 replicates reject both in every arm, and
300 of 300 in the untruncated temperature and penalties arms (power >= 0.99 at 95 % confidence). The informative
mass those simulations see (0.88-1.00) is what these arms measure (0.87 penalties, 0.89 temperature, 0.88 block 16,
0.98 top-k/top-p, 1.00 min_p); on a prose prompt the target is too flat (797 distinct triples in 800).
Each arm prints its p-value and informative mass (pytest -s) and needs at least 5 %. The arm that catches wrong
bonus rules verifies width 2 (dflash_adaptive, fixed_block 2: a full accept, then the bonus, inside the first three
tokens); the block-16 arm (upstream dflash) covers rejections deep in a wide block; the width-1 arms cover the
accept of a step with nothing to verify (its own sampling, no chain kernel) with the same statistic and sample
size (a sharpened distribution, softmax(2 x logits), fails the temperature arm: checked by hand, p < 1e-4).
"""
from __future__ import annotations

import json
import urllib.request

import pytest

from tests.conftest import default_config
from tests.sampling_stats import ALPHA, N_PER_ARM, homogeneity_pvalue, informative_mass

pytestmark = pytest.mark.server

PROMPT = "def fib(n):\n    if n < 2:\n        return n\n"  # the most peaked of the conftest prompts at T = 1
CONFIGS = {
    "temperature": {},
    "top_k_top_p": {"top_k": 8, "top_p": 0.9},
    "min_p": {"min_p": 0.1},
    "penalties": {"repetition_penalty": 1.3, "frequency_penalty": 0.5},
}


def fixed_width_server(module_server_factory, tiny_pair, width: int):
    cfg = default_config(tiny_pair, algorithm="dflash_adaptive", draft_model_path=tiny_pair["drafter"],
                         adaptive={"mode": "fixed", "fixed_block": width})
    return module_server_factory(cfg, f"adaptive-width{width}")


@pytest.fixture(scope="module")
def width2_server(module_server_factory, tiny_pair):
    return fixed_width_server(module_server_factory, tiny_pair, 2)


@pytest.fixture(scope="module")
def width1_server(module_server_factory, tiny_pair):
    return fixed_width_server(module_server_factory, tiny_pair, 1)


def sample(server, sampling: dict, n: int = N_PER_ARM) -> list[tuple]:
    body = {"text": [PROMPT] * n,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 3, "ignore_eos": True, **sampling}}
    req = urllib.request.Request(f"{server.url}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as r:
        out = [tuple(o["output_ids"]) for o in json.load(r)]
    assert all(len(t) == 3 for t in out)
    return out


_PLAIN: dict[tuple[str, str], list[tuple]] = {}


def plain_sample(plain_server, config: str) -> list[tuple]:
    """Plain decoding's sample for ``config``, drawn once per session: every arm compares its own fresh
    speculative sample against it (each comparison keeps its level; they share the reference, not their samples)."""
    key = (plain_server.url, config)
    if key not in _PLAIN:
        _PLAIN[key] = sample(plain_server, CONFIGS[config])
    return _PLAIN[key]


def assert_same_distribution(label: str, plain: list[tuple], spec: list[tuple]) -> None:
    p, mass = homogeneity_pvalue(plain, spec), informative_mass(plain, spec)
    print(f"{label}: p = {p:.4f}, informative mass {mass:.2f} ({len(set(plain))} distinct triples)")
    assert mass >= 0.05  # resolved cells hold enough of the samples to compare
    assert p >= ALPHA


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_width2_samples_have_the_target_distribution(config, plain_server, width2_server):
    assert_same_distribution(config, plain_sample(plain_server, config), sample(width2_server, CONFIGS[config]))


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_width1_samples_have_the_target_distribution(config, plain_server, width1_server):
    """Width 1 ("speculation off") samples each token itself (steps/accept.py accept_width1: a softmax without cuts, the
    patched target distribution with them, penalties and logit_bias first), not through the chain accept."""
    assert_same_distribution(f"width 1, {config}", plain_sample(plain_server, config),
                             sample(width1_server, CONFIGS[config]))


def test_block16_samples_have_the_target_distribution(plain_server, dflash_server):
    assert_same_distribution("block 16", plain_sample(plain_server, "temperature"), sample(dflash_server, {}))
