"""The blockwise method's parts against brute force: which (attention groups, MLP channels) counts are feasible, the
importance a candidate removes, the choice under each criterion, ties, and the layer range at its edges (pure
planning: no model, milliseconds)."""

import numpy as np
import pytest

from taylor_tune.config import PruneConfig
from taylor_tune.errors import PlanError
from taylor_tune.pruning.methods import PlanOptions
from taylor_tune.pruning.methods.blockwise import (
    block_plan,
    blockwise_range,
    feasible_block_counts,
    plan_blockwise,
    removal_loss,
)
from taylor_tune.pruning.plan import GroupScores, ModelLayout
from tests.helpers import equal_layers as layout


def options(**kw) -> PlanOptions:
    kw.setdefault("blockwise_attention", "min_loss")
    return PlanOptions.of(PruneConfig(model="tiny-llama", method="blockwise", **kw))


def grid_feasible(lay: ModelLayout, layers: range, target: float) -> list[tuple[int, int]]:
    """Every pair (k groups out of each block, channels in all) that leaves each block a group and each block's
    channels one at least, and removes the target or more but less than one group more; per k the fewest channels."""
    g, c, a, m, n = lay.attn_groups[0], lay.mlp_channels[0], lay.attn_group_params, lay.mlp_channel_params, len(layers)
    pairs = [(k, ch) for k in range(g) for ch in range(n * (c - 1) + 1)
             if target <= n * k * a + ch * m < target + max(a, m)]
    return [(k, min(ch for kk, ch in pairs if kk == k)) for k in sorted({k for k, _ in pairs})]


# a group heavier than a channel (as in LLMs) and one lighter, each over a range that keeps layers outside it
@pytest.mark.parametrize("g, c, a, m, layers, blocks", [(3, 4, 40, 10, 4, range(1, 3)), (4, 5, 7, 12, 5, range(1, 4))])
def test_feasible_counts_equal_a_grid_search_for_every_integer_target(g, c, a, m, layers, blocks):
    lay = layout(g, c, a, m, layers)
    # every integer target from nothing to more than the range holds: each boundary is met exactly somewhere
    for target in range(len(blocks) * (g * a + c * m) + 1):
        expected = grid_feasible(lay, blocks, target)
        if expected:
            assert feasible_block_counts(lay, blocks, target) == expected, target
        else:
            with pytest.raises(PlanError, match=rf"layers {blocks[0]}\.\.{blocks[-1]} cannot give {target} "):
                feasible_block_counts(lay, blocks, target)


@pytest.mark.parametrize("which", ["attention", "mlp"])
def test_blocks_of_different_sizes_are_refused(which):
    """An already pruned model: one block in range narrower than the others, in its attention or its MLP alone."""
    lay = layout(4, 8, 20, 5, 4)
    groups, channels = list(lay.attn_groups), list(lay.mlp_channels)
    (groups if which == "attention" else channels)[2] -= 1
    narrowed = ModelLayout(tuple(groups), tuple(channels), 20, 5, lay.layer_params, lay.total_params)
    with pytest.raises(PlanError, match="different sizes"):
        feasible_block_counts(narrowed, range(1, 3), 20)
    assert feasible_block_counts(narrowed, range(2), 20)  # the narrowed block outside the range: planned


def lowest(scores: np.ndarray, count: int) -> list[int]:
    """The `count` lowest-scored indices, ties to the lower index."""
    return sorted(range(len(scores)), key=lambda i: (scores[i], i))[:count]


def spread(total: int, blocks: int) -> list[int]:
    """`total` channels over `blocks` blocks as evenly as counts allow, the first blocks taking the remainder."""
    counts = [0] * blocks
    for i in range(total):
        counts[i % blocks] += 1
    return counts


def removed_importance(scores, lay, blocks, k, channels, criterion) -> float:
    """Σ over the removed groups of score × group size (score alone for taylor_sum, whose scores are sums already)."""
    a, m = (1, 1) if criterion == "taylor_sum" else (lay.attn_group_params, lay.mlp_channel_params)
    return sum(a * sum(scores.attn[l][i] for i in lowest(scores.attn[l], k))
               + m * sum(scores.mlp[l][i] for i in lowest(scores.mlp[l], p))
               for l, p in zip(blocks, spread(channels, len(blocks))))


def random_scores(lay: ModelLayout, seed: int, attention_scale: float = 1.0) -> GroupScores:
    rng = np.random.default_rng(seed)
    return GroupScores(tuple(rng.random(g) * attention_scale for g in lay.attn_groups),
                       tuple(rng.random(c) for c in lay.mlp_channels))


@pytest.mark.parametrize("criterion", ["taylor", "taylor_sum", "l1"])
@pytest.mark.parametrize("seed", [0, 1])
def test_removal_loss_is_the_importance_of_the_groups_removed(criterion, seed):
    lay, blocks = layout(4, 8, 40, 10, 5), range(1, 4)
    scores = random_scores(lay, seed)
    for k in range(4):
        for channels in (0, 1, 5, 7, 21):
            assert removal_loss(scores, lay, blocks, k, channels, criterion) == pytest.approx(
                removed_importance(scores, lay, blocks, k, channels, criterion), rel=1e-12, abs=0.0)


def test_min_loss_weighs_by_group_size_unless_the_scores_are_sums():
    """taylor_sum's scores are sums over a group's parameters already: min_loss compares them as they are, the other
    criteria's per-parameter means times the group's size. On the same numbers the two choices differ."""
    lay = layout(3, 16, 40, 10, 6)
    blocks, target = range(1, 5), 0.2 * lay.total_params
    chosen = {}
    for criterion in ("taylor", "taylor_sum"):
        for seed in range(8):
            scores = random_scores(lay, seed, attention_scale=np.random.default_rng(seed).uniform(0.2, 2.0))
            plan = plan_blockwise(scores, lay, options(sparsity=0.2, criterion=criterion))
            expected = min(grid_feasible(lay, blocks, target),
                           key=lambda kc: (removed_importance(scores, lay, blocks, *kc, criterion), kc[0]))
            assert [len(plan.attn_removed[l]) for l in blocks] == [expected[0]] * len(blocks)
            assert sum(map(len, plan.mlp_removed)) == expected[1]
            chosen[criterion, seed] = expected[0]
    assert any(chosen["taylor", s] != chosen["taylor_sum", s] for s in range(8))  # the test tells them apart


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tied_scores_remove_the_lower_index(seed):
    """Scores from three values, so most groups tie: the plan takes, in every block, the lowest scores and among
    equal ones the lower index (as ranked_groups), whatever order a sort would leave them in."""
    lay, blocks = layout(8, 32, 40, 10, 5), range(1, 4)
    rng = np.random.default_rng(seed)
    scores = GroupScores(tuple(rng.integers(0, 3, 8).astype(float) for _ in range(5)),
                         tuple(rng.integers(0, 3, 32).astype(float) for _ in range(5)))
    plan = block_plan(scores, lay, blocks, 3, 40)
    for l, p in zip(blocks, spread(40, 3)):
        assert plan.attn_removed[l] == tuple(sorted(lowest(scores.attn[l], 3)))
        assert plan.mlp_removed[l] == tuple(sorted(lowest(scores.mlp[l], p)))
    assert not any(plan.attn_removed[l] or plan.mlp_removed[l] for l in (0, 4))


def test_the_range_may_end_at_the_last_layer_but_not_be_empty():
    lay = layout(4, 8, 20, 5, 4)
    assert blockwise_range(lay, options(blockwise_layer_start=1, blockwise_layer_end=4)) == range(1, 4)
    plan = plan_blockwise(random_scores(lay, 0), lay, options(sparsity=0.1, blockwise_layer_start=2,
                                                              blockwise_layer_end=4))
    assert plan.mlp_removed[3] and not plan.mlp_removed[1]  # the last layer pruned, the ones before the range not
    # a start at the last layer with the default end (the last layer, kept) leaves nothing: refused by name
    with pytest.raises(PlanError, match=r"layer range \[3, 3\) is empty"):
        blockwise_range(lay, options(blockwise_layer_start=3))
    with pytest.raises(PlanError, match=r"layer range \[1, 5\) is empty or outside the model's 4 layers"):
        blockwise_range(lay, options(blockwise_layer_end=5))
