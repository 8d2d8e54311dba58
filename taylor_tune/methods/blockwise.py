"""blockwise: as LLM-Pruner's block-wise mode, one ratio for every attention and MLP block in a layer range.

Layers outside [start, end) are untouched (default: the first and the last layer are kept). Every in-range
attention block loses the same number k of its G attention groups; the MLP blocks lose the channels still
needed to reach the target, spread evenly (counts differ by at most one channel between blocks, the
granularity that lets the total stop within one group of the target). Among the feasible k, the one whose
attention ratio k/G is closest to the MLP ratio is chosen, so attention and MLP lose the same share as
nearly as the group sizes allow. Inside each block the lowest-scored groups go.
"""

from __future__ import annotations

import math

from taylor_tune.errors import PlanError
from taylor_tune.methods._base import Method, PlanOptions
from taylor_tune.plan import GroupScores, ModelLayout, PrunePlan, plan_from_sets, target_params


def blockwise_range(layout: ModelLayout, options: PlanOptions) -> range:
    start = 1 if options.blockwise_layer_start is None else options.blockwise_layer_start
    end = layout.num_layers - 1 if options.blockwise_layer_end is None else options.blockwise_layer_end
    if not 0 <= start < end <= layout.num_layers:
        raise PlanError(
            f"blockwise: layer range [{start}, {end}) is empty or outside the model's {layout.num_layers} layers; "
            "set blockwise_layer_start / blockwise_layer_end"
        )
    return range(start, end)


def solve_block_counts(layout: ModelLayout, layers: range, target: float) -> tuple[int, int]:
    """(attention groups per block, MLP channels in all): the feasible pair with the closest ratios."""
    a, m, n = layout.attn_group_params, layout.mlp_channel_params, len(layers)
    groups = {layout.attn_groups[l] for l in layers}
    channels = {layout.mlp_channels[l] for l in layers}
    if len(groups) != 1 or len(channels) != 1:
        raise PlanError("blockwise: layers in range have different sizes (was the model already pruned?)")
    g, c = groups.pop(), channels.pop()
    best = None
    for k in range(g):  # k = g would empty the attention blocks
        rest = target - n * k * a
        mlp_total = max(0, math.ceil(rest / m))
        if mlp_total > n * (c - 1) or n * k * a + mlp_total * m - target >= max(a, m):
            continue  # MLP blocks would be emptied, or the attention alone overshoots by a group or more
        gap = abs(k / g - mlp_total / (n * c))
        if best is None or gap < best[0]:
            best = (gap, k, mlp_total)
    if best is None:
        raise PlanError(
            f"blockwise: layers {layers.start}..{layers.stop - 1} cannot give {target:.0f} parameters without "
            "emptying a block; widen the layer range or lower the sparsity"
        )
    return best[1], best[2]


def plan_blockwise(scores: GroupScores, layout: ModelLayout, options: PlanOptions) -> PrunePlan:
    scores.check_matches(layout)
    layers = blockwise_range(layout, options)
    attn_per_block, mlp_total = solve_block_counts(layout, layers, target_params(layout, options.sparsity))
    attn = [set() for _ in range(layout.num_layers)]
    mlp = [set() for _ in range(layout.num_layers)]
    for position, layer in enumerate(layers):
        mlp_here = mlp_total // len(layers) + (1 if position < mlp_total % len(layers) else 0)
        # argsort with a stable kind: ties go to the lower index, as in ranked_groups
        attn[layer] = set(scores.attn[layer].argsort(kind="stable")[:attn_per_block].tolist())
        mlp[layer] = set(scores.mlp[layer].argsort(kind="stable")[:mlp_here].tolist())
    return plan_from_sets("blockwise", attn, mlp)


METHOD = Method("blockwise", "taylor", plan_blockwise, "same ratio for every block in a layer range (LLM-Pruner)")
