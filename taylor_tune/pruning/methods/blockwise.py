"""blockwise: as LLM-Pruner's block-wise mode, one ratio for every attention and MLP block in a layer range.

Layers outside [start, end) are untouched (default: the first and the last layer are kept). Every in-range
attention block loses the same number k of its G attention groups; the MLP blocks lose the channels still
needed to reach the target, spread evenly (counts differ by at most one channel between blocks, the
granularity that lets the total stop within one group of the target). Inside each block the lowest-scored
groups go. Which k, among the feasible ones, is the rule `blockwise_attention`:
- `measured_loss` (default): the k whose whole plan gives the lowest calibration loss, measured: the model with the
  candidate plan's groups masked, forwarded on calibration sequences (`PlanOptions.plan_loss`, given by the caller
  that holds the model). One forward pass per feasible k, at most G. The first-order sum that min_loss compares
  misjudges a whole attention group at small calibrations (BENCHMARKS.md).
- `min_loss`: the k whose plan removes the least importance in total (Σ over removed groups of score ×
  group size, i.e. the salience Σ|w·ḡ| removed for the default criterion; the scores as given for taylor_sum).
- `closest_ratio`: the k whose attention ratio k/G is closest to the MLP ratio, so attention and MLP lose the same
  share as nearly as the group sizes allow (LLM-Pruner's one ratio for every block, as near as groups allow).
- `mlp_only`: k = 0; the MLP blocks give the whole budget (always, where attention is kept: the servable layout).
BENCHMARKS.md compares the rules.
"""

from __future__ import annotations

import math

import numpy as np

from taylor_tune.config import BLOCKWISE_ATTENTION_RULES
from taylor_tune.errors import PlanError
from taylor_tune.pruning.methods._base import Method, PlanOptions, Scoring
from taylor_tune.pruning.plan import GroupScores, ModelLayout, PrunePlan, plan_from_sets, target_params


def blockwise_range(layout: ModelLayout, options: PlanOptions) -> range:
    start = 1 if options.blockwise_layer_start is None else options.blockwise_layer_start
    end = layout.num_layers - 1 if options.blockwise_layer_end is None else options.blockwise_layer_end
    if not 0 <= start < end <= layout.num_layers:
        raise PlanError(
            f"blockwise: layer range [{start}, {end}) is empty or outside the model's {layout.num_layers} layers; "
            "set blockwise_layer_start / blockwise_layer_end"
        )
    return range(start, end)


ATTENTION_RULES = BLOCKWISE_ATTENTION_RULES


def feasible_block_counts(layout: ModelLayout, layers: range, target: float) -> list[tuple[int, int]]:
    """Every (attention groups per block k, MLP channels in all) that meets the target within one group and
    leaves every block at least one group, k ascending."""
    a, m, n = layout.attn_group_params, layout.mlp_channel_params, len(layers)
    groups = {layout.attn_groups[l] for l in layers}
    channels = {layout.mlp_channels[l] for l in layers}
    if len(groups) != 1 or len(channels) != 1:
        raise PlanError("blockwise: layers in range have different sizes (was the model already pruned?)")
    g, c = groups.pop(), channels.pop()
    feasible = []
    for k in range(g):  # k = g would empty the attention blocks
        mlp_total = max(0, math.ceil((target - n * k * a) / m))
        if mlp_total > n * (c - 1) or n * k * a + mlp_total * m - target >= max(a, m):
            continue  # MLP blocks would be emptied, or the attention alone overshoots by a group or more
        feasible.append((k, mlp_total))
    if not feasible:
        raise PlanError(
            f"blockwise: layers {layers.start}..{layers.stop - 1} cannot give {target:.0f} parameters without "
            "emptying a block; widen the layer range or lower the sparsity"
        )
    return feasible


def _per_block(total: int, layers: range) -> list[int]:
    """`total` MLP channels spread over the blocks, the first ones taking one more where it does not divide."""
    n = len(layers)
    return [total // n + (1 if position < total % n else 0) for position in range(n)]


def removal_loss(
    scores: GroupScores, layout: ModelLayout, layers: range, k: int, mlp_total: int, criterion: str
) -> float:
    """Importance removed by the plan with k groups per block and `mlp_total` channels: Σ score × group size over
    the lowest groups of each block (the plain score sum where scores are already sums, criterion taylor_sum)."""
    a, m = (1, 1) if criterion == "taylor_sum" else (layout.attn_group_params, layout.mlp_channel_params)
    loss = 0.0
    for layer, channels in zip(layers, _per_block(mlp_total, layers)):
        loss += a * float(np.sort(scores.attn[layer])[:k].sum()) + m * float(
            np.sort(scores.mlp[layer])[:channels].sum()
        )
    return loss


def choose_block_counts(scores: GroupScores, layout: ModelLayout, layers: range, target: float,
                        rule: str, criterion: str, plan_loss=None) -> tuple[int, int]:
    """(attention groups per block, MLP channels in all) by the attention rule (see the module docstring)."""
    feasible = feasible_block_counts(layout, layers, target)
    g, c, n = layout.attn_groups[layers.start], layout.mlp_channels[layers.start], len(layers)
    if rule == "closest_ratio":  # ties: the smaller k (min keeps the first)
        return min(feasible, key=lambda kc: abs(kc[0] / g - kc[1] / (n * c)))
    if rule == "mlp_only":
        if feasible[0][0] != 0:
            raise PlanError("blockwise: the MLP blocks alone cannot give the target; use blockwise_attention min_loss")
        return feasible[0]
    if rule == "min_loss":
        return min(feasible, key=lambda kc: removal_loss(scores, layout, layers, *kc, criterion))
    if rule == "measured_loss":
        if plan_loss is None:
            raise PlanError("blockwise: blockwise_attention measured_loss needs the model (PlanOptions.plan_loss)")
        # ties: the smaller k (min keeps the first)
        return min(feasible, key=lambda kc: plan_loss(block_plan(scores, layout, layers, *kc)))
    raise PlanError(f"blockwise: unknown blockwise_attention {rule!r}; allowed: {', '.join(ATTENTION_RULES)}")


def block_plan(scores: GroupScores, layout: ModelLayout, layers: range, attn_per_block: int,
               mlp_total: int) -> PrunePlan:
    """The plan with `attn_per_block` groups out of every block and `mlp_total` channels spread: the lowest-scored."""
    attn = [set() for _ in range(layout.num_layers)]
    mlp = [set() for _ in range(layout.num_layers)]
    for layer, mlp_here in zip(layers, _per_block(mlp_total, layers)):
        # argsort with a stable kind: ties go to the lower index, as in ranked_groups
        attn[layer] = set(scores.attn[layer].argsort(kind="stable")[:attn_per_block].tolist())
        mlp[layer] = set(scores.mlp[layer].argsort(kind="stable")[:mlp_here].tolist())
    return plan_from_sets("blockwise", attn, mlp)


def plan_blockwise(scores: GroupScores, layout: ModelLayout, options: PlanOptions) -> PrunePlan:
    scores.check_matches(layout)
    layers = blockwise_range(layout, options)
    rule = options.blockwise_attention if options.attention else "mlp_only"
    counts = choose_block_counts(scores, layout, layers, target_params(layout, options.sparsity), rule,
                                 options.criterion, options.plan_loss)
    return block_plan(scores, layout, layers, *counts)


METHOD = Method("blockwise", Scoring.CRITERION, plan_blockwise)
