"""DDTree's tensor logic (sglang_ext/tree/) against brute force on small vocabularies: the tree is the N best
draft prefixes, parents first; the walk commits exactly the target's own choices; the mask lets a node see the
root, its ancestors and itself only; the window's reorder puts the committed path first."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ext.tree.build import Trees, build_trees, prefix_count
from sglang_ext.tree.commit import window_order
from sglang_ext.tree.marginals import top_log_probs
from sglang_ext.tree.mask import ancestor_mask, packed, positions, unpacked
from sglang_ext.tree.walk import walk


def marginals(bs: int, depth: int, k: int, vocab: int, seed: int, ties: bool = False):
    """Top-k log-probabilities (sorted) and distinct token ids per position; ``ties``: coarse values that tie."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, depth, vocab, generator=g, dtype=torch.float64)
    if ties:
        logits = logits.round()
    logp = torch.log_softmax(logits, dim=-1)
    top = torch.topk(logp, k, dim=-1)
    return top.values, top.indices


def brute_force_scores(logp: torch.Tensor, n: int) -> list[float]:
    """The n best prefix scores of one request, by enumerating every prefix."""
    depth, k = logp.shape
    out = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            out.append(float(sum(logp[j, r] for j, r in enumerate(ranks))))
    return sorted(out, reverse=True)[:n]


def paths(trees: Trees, row: int) -> list[tuple[int, ...]]:
    """Each node's prefix (token ids root to node), from the parent pointers."""
    out: list[tuple[int, ...]] = []
    for i in range(trees.budget):
        p = int(trees.parent[row, i])
        out.append((out[p] if p >= 0 else ()) + (int(trees.token[row, i]),))
    return out


@settings(max_examples=60, deadline=None)
@given(bs=st.integers(1, 3), depth=st.integers(1, 4), k=st.integers(1, 4), vocab=st.integers(4, 7),
       seed=st.integers(0, 10_000), ties=st.booleans(), data=st.data())
def test_the_tree_is_the_n_best_prefixes_parents_first(bs, depth, k, vocab, seed, ties, data):
    logp, tokens = marginals(bs, depth, k, vocab, seed, ties)
    n = data.draw(st.integers(1, prefix_count(depth, k)))
    trees = build_trees(logp, tokens, n)
    assert trees.token.shape == trees.depth.shape == trees.parent.shape == (bs, n)
    for r in range(bs):
        assert trees.score[r].tolist() == pytest.approx(brute_force_scores(logp[r], n), abs=1e-9)
        assert trees.score[r].tolist() == sorted(trees.score[r].tolist(), reverse=True)
        for i in range(n):
            p = int(trees.parent[r, i])
            assert p < i
            assert int(trees.depth[r, i]) == (1 if p < 0 else int(trees.depth[r, p]) + 1)
        spelled = paths(trees, r)
        assert len(set(spelled)) == n  # no prefix twice
        for i, prefix in enumerate(spelled):  # the node's score is its own prefix's
            d = len(prefix)
            ranks = [int((tokens[r, j] == t).nonzero()) for j, t in enumerate(prefix)]
            assert float(trees.score[r, i]) == pytest.approx(float(sum(logp[r, j, ranks[j]] for j in range(d))))


def test_budget_bounds_and_shapes_are_refused_with_the_limit():
    logp, tokens = marginals(1, 2, 2, 5, 0)
    with pytest.raises(ValueError, match=r"budget: must be in 1\.\.6"):
        build_trees(logp, tokens, 7)
    with pytest.raises(ValueError, match="budget"):
        build_trees(logp, tokens, 0)
    with pytest.raises(ValueError, match="shapes"):
        build_trees(logp, tokens[:, :1], 3)


def test_a_chain_budget_of_top_1_is_the_greedy_draft():
    logp, tokens = marginals(2, 5, 1, 9, 3)
    trees = build_trees(logp, tokens, 5)
    assert torch.equal(trees.token, tokens[:, :, 0])
    assert trees.parent.tolist() == [[-1, 0, 1, 2, 3]] * 2


def test_equal_inputs_build_equal_trees():
    """Every tensor-parallel rank builds its own tree from the same marginals: it must be the same tree."""
    logp, tokens = marginals(4, 6, 4, 8, 11, ties=True)
    a, b = build_trees(logp, tokens, 40), build_trees(logp.clone(), tokens.clone(), 40)
    assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("token", "depth", "parent", "score"))


def reference_walk(trees: Trees, choice: torch.Tensor, row: int) -> list[int]:
    """Committed tokens of one request: follow the target's choice through the children while one matches."""
    committed, cur = [], -1
    while True:
        want = int(choice[row, cur + 1])
        children = [i for i in range(trees.budget) if int(trees.parent[row, i]) == cur]
        nxt = [i for i in children if int(trees.token[row, i]) == want]
        committed.append(want)
        if not nxt:
            return committed
        cur = nxt[0]


@settings(max_examples=60, deadline=None)
@given(bs=st.integers(1, 4), depth=st.integers(1, 5), k=st.integers(1, 3), seed=st.integers(0, 10_000),
       follow=st.floats(0.0, 1.0), data=st.data())
def test_the_walk_commits_the_targets_choices_along_the_tree(bs, depth, k, seed, follow, data):
    vocab = 6
    logp, tokens = marginals(bs, depth, k, vocab, seed)
    trees = build_trees(logp, tokens, data.draw(st.integers(1, prefix_count(depth, k))))
    g = torch.Generator().manual_seed(seed + 1)
    choice = torch.randint(0, vocab, (bs, trees.budget + 1), generator=g)
    # make the target agree with some drafted children, so walks go deep as well as stop early
    for r in range(bs):
        for i in range(-1, trees.budget):
            kids = [c for c in range(trees.budget) if int(trees.parent[r, c]) == i]
            if kids and torch.rand(1, generator=g).item() < follow:
                choice[r, i + 1] = trees.token[r, kids[int(torch.randint(len(kids), (1,), generator=g))]]
    accepted, path, bonus = walk(trees, choice)
    for r in range(bs):
        want = reference_walk(trees, choice, r)
        a = int(accepted[r])
        assert a == len(want) - 1
        assert [int(trees.token[r, i]) for i in path[r, :a]] + [int(bonus[r])] == want
        assert (path[r, a:] == -1).all()


@settings(max_examples=60, deadline=None)
@given(bs=st.integers(1, 3), depth=st.integers(1, 5), k=st.integers(1, 3), seed=st.integers(0, 10_000),
       follow=st.floats(0.3, 1.0), data=st.data())
def test_one_walk_tells_what_every_narrower_tree_and_the_chain_would_have_accepted(bs, depth, k, seed, follow, data):
    """controller/tree_gain.py's claim: with the target's choice a function of the prefix (greedy, or one draw per
    prefix), the tree of the best n prefixes -- built on its own -- accepts exactly the walked path's nodes before
    its first node outside the first n of the wider tree; and the chain accepts the path's agreement with the
    greedy draft while the path stays on the tree."""
    from sglang_ext.controller.tree_gain import tree_commits

    vocab = 6
    logp, tokens = marginals(bs, depth, k, vocab, seed)  # continuous scores: no ties, so trees nest exactly
    wide = data.draw(st.integers(1, prefix_count(depth, k)))
    g = torch.Generator().manual_seed(seed + 7)
    drawn: dict[tuple[int, tuple[int, ...]], int] = {}

    def target(r: int, prefix: tuple[int, ...]) -> int:  # the target's choice after a prefix, fixed once drawn
        key = (r, prefix)
        if key not in drawn:
            d = len(prefix)
            greedy = d < depth and torch.rand(1, generator=g).item() < follow
            drawn[key] = int(tokens[r, d, 0]) if greedy else int(torch.randint(vocab, (1,), generator=g))
        return drawn[key]

    def choices(trees: Trees) -> torch.Tensor:
        out = torch.empty(bs, trees.budget + 1, dtype=torch.int64)
        for r in range(bs):
            out[r] = torch.tensor([target(r, ())] + [target(r, p) for p in paths(trees, r)])
        return out

    trees = build_trees(logp, tokens, wide)
    accepted, path, _ = walk(trees, choices(trees), depth=depth)
    widths = list(range(2, wide + 2))  # width w: the tree of w - 1 prefixes
    predicted = tree_commits(path.numpy(), widths)
    for w in widths:
        narrow = build_trees(logp, tokens, w - 1)
        assert walk(narrow, choices(narrow), depth=depth)[0].tolist() == predicted[:, w - 2].tolist()
    chain = build_trees(logp[:, :, :1], tokens[:, :, :1], depth)  # the greedy chain is a tree of top-1 tokens
    chain_acc = walk(chain, choices(chain), depth=depth)[0]
    greedy = tokens[:, :, 0]
    committed = [[int(trees.token[r, i]) for i in path[r, : int(accepted[r])]] for r in range(bs)]
    for r in range(bs):
        agree = 0
        while agree < len(committed[r]) and committed[r][agree] == int(greedy[r, agree]):
            agree += 1
        if agree < int(accepted[r]) or int(accepted[r]) == depth:  # the path left the chain inside the tree
            assert int(chain_acc[r]) == agree
        else:  # the chain may go on where the tree had no node: the agreement is a lower bound
            assert int(chain_acc[r]) >= agree


def test_walk_refuses_a_choice_of_the_wrong_width():
    logp, tokens = marginals(1, 2, 2, 5, 0)
    with pytest.raises(ValueError, match=r"choice: expected shape \(1, 4\)"):
        walk(build_trees(logp, tokens, 3), torch.zeros(1, 3, dtype=torch.int64))


def test_mask_is_root_ancestors_and_self():
    logp, tokens = marginals(3, 4, 3, 7, 5)
    trees = build_trees(logp, tokens, 20)
    mask = ancestor_mask(trees.parent)
    assert mask.shape == (3, 21, 21)
    for r in range(3):
        for i in range(21):
            seen = {0, i}
            p = int(trees.parent[r, i - 1]) if i else -1
            while p >= 0:
                seen.add(p + 1)
                p = int(trees.parent[r, p])
            assert set(mask[r, i].nonzero().flatten().tolist()) == seen
    pos = positions(torch.tensor([5, 0, 9]), trees.depth)
    assert pos[:, 0].tolist() == [5, 0, 9]
    assert torch.equal(pos[:, 1:] - pos[:, :1], trees.depth)


@settings(max_examples=60, deadline=None)
@given(bs=st.integers(1, 4), depth=st.integers(1, 4), k=st.integers(1, 3), seed=st.integers(0, 10_000),
       slack=st.integers(0, 40), data=st.data())
def test_the_packed_mask_holds_the_tree_where_the_gpu_reads_it_and_the_cpu_reads_it_back(bs, depth, k, seed, slack,
                                                                                         data):
    """The layout every device is handed (the worker packs; the CPU attention unpacks): request b's row i is
    prefix_b + m cells from its start, the prefix columns visible, then the tree's row; a host bound above the true
    prefix sum leaves the tail unread."""
    logp, tokens = marginals(bs, depth, k, 9, seed)
    n = data.draw(st.integers(1, prefix_count(depth, k)))
    mask = ancestor_mask(build_trees(logp, tokens, n).parent)
    m = n + 1
    prefix = torch.tensor(data.draw(st.lists(st.integers(0, 12), min_size=bs, max_size=bs)))
    flat = packed(mask, prefix, int(prefix.sum()) + slack)
    assert flat.shape == ((int(prefix.sum()) + slack) * m + bs * m * m,)
    assert torch.equal(unpacked(flat, prefix, m), mask)
    start = 0
    for b in range(bs):
        p = int(prefix[b])
        rows = flat[start: start + m * (p + m)].view(m, p + m)
        assert rows[:, :p].all() and torch.equal(rows[:, p:], mask[b])
        start += m * (p + m)


@settings(max_examples=60, deadline=None)
@given(bs=st.integers(1, 4), depth=st.integers(1, 5), k=st.integers(1, 3), seed=st.integers(0, 10_000),
       data=st.data())
def test_window_order_puts_the_committed_path_first(bs, depth, k, seed, data):
    logp, tokens = marginals(bs, depth, k, 6, seed)
    trees = build_trees(logp, tokens, data.draw(st.integers(1, prefix_count(depth, k))))
    n = trees.budget + 1
    choice = torch.randint(0, 6, (bs, n), generator=torch.Generator().manual_seed(seed))
    choice[:, 0] = trees.token[:, 0]  # at least one step down the tree for every request
    accepted, path, _ = walk(trees, choice)
    order = window_order(path, n)
    for r in range(bs):
        row, a = order[r].tolist(), int(accepted[r])
        assert sorted(row) == list(range(n))  # a permutation: every slot stays with the request
        assert row[: a + 1] == [0] + [1 + int(p) for p in path[r, :a]]  # root, then the path's columns
        assert row[a + 1:] == sorted(row[a + 1:])  # the rest in column order


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.integers(1, 700), k=st.integers(1, 40), seed=st.integers(0, 10_000),
       ties=st.booleans())
def test_top_log_probs_are_the_k_largest_of_log_softmax(rows, vocab, k, seed, ties):
    """The chunked top-k (vocabularies not a multiple of the chunk, more chunks than k and fewer) against
    torch.topk of log_softmax: the same values, distinct tokens that carry them."""
    k = min(k, vocab)
    logits = torch.randn(rows, 3, vocab, generator=torch.Generator().manual_seed(seed)) * 4
    if ties:
        logits = logits.round()
    logp, tokens = top_log_probs(logits, k)
    want = torch.topk(torch.log_softmax(logits, dim=-1), k, dim=-1)
    torch.testing.assert_close(logp, want.values, rtol=0, atol=1e-5)
    assert all(len(set(r.tolist())) == k for r in tokens.view(-1, k))
    torch.testing.assert_close(torch.log_softmax(logits, dim=-1).gather(-1, tokens), logp, rtol=0, atol=1e-5)
