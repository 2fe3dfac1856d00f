"""The trees' learned gain over chain B (sglang_ext/controller/tree_gain.py)."""
from __future__ import annotations

import numpy as np
import pytest

from sglang_ext.controller.tree_gain import TreeGain, tree_commits


def test_a_narrow_tree_step_teaches_only_the_trees_it_contains():
    """A step at width 20 says nothing about width 32 (its extra nodes were not verified): that estimate stays."""
    gain = TreeGain((20, 32), decay=1.0, prior_strength=0.0)
    gain.observe(np.array([[1.0, 3.0], [1.0, 5.0]]), np.array([True, True]))
    gain.observe(np.array([[-2.0, 99.0]]), np.array([True, False]))
    np.testing.assert_allclose(gain.extra(), [0.0, 4.0])
    assert gain.steps.tolist() == [2, 1]
    with pytest.raises(ValueError, match=r"extra: expected \[bs, 2\]"):
        gain.observe(np.zeros((1, 3)), np.array([True, True]))


def test_tree_commits_count_the_path_up_to_its_first_node_outside_the_narrower_tree():
    path = np.array([[0, 2, 9, 30, -1], [-1, -1, -1, -1, -1]])
    assert tree_commits(path, [2, 4, 11, 31, 32]).tolist() == [[1, 2, 3, 3, 4], [0, 0, 0, 0, 0]]
