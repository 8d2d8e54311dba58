"""layerwise: each layer gets its own ratio from its layer-level importance, capped; inside a layer the lowest groups
go.

Layer importance I_l is the layer's mean salience per prunable parameter (its group scores weighted by
group size). Ratios follow the inverse relative importance, r_l = min(cap, c * mean(I) / I_l), with c
solved so that the ratios add up to the target ("water-filling" under the cap). Each layer first drops its
lowest groups within its own budget; the rounding remainder is then taken from the lowest remaining groups
of the whole model among layers still under the cap, so the total stops within one group of the target. Where
attention is kept (the servable layout), a layer's importance and its removals are its MLP channels'.
"""

from __future__ import annotations

import numpy as np

from taylor_tune.errors import PlanError
from taylor_tune.pruning.methods._base import Method, PlanOptions, Scoring, kinds
from taylor_tune.pruning.plan import GroupScores, ModelLayout, PrunePlan, plan_from_sets, ranked_groups, target_params


def layer_importance(scores: GroupScores, layout: ModelLayout, attention: bool = True) -> np.ndarray:
    """Each layer's mean salience per prunable parameter: over its MLP channels alone where attention is kept."""
    a, m = layout.attn_group_params, layout.mlp_channel_params
    if not attention:
        return np.array([scores.mlp[l].mean() for l in range(layout.num_layers)], dtype=np.float64)
    return np.array([
        (scores.attn[l].sum() * a + scores.mlp[l].sum() * m) / (len(scores.attn[l]) * a + len(scores.mlp[l]) * m)
        for l in range(layout.num_layers)
    ], dtype=np.float64)


def allocate_layer_ratios(importance: np.ndarray, layer_params: np.ndarray, target: float, cap: float) -> np.ndarray:
    """Per-layer ratios, inversely proportional to importance, each <= cap, removing `target` parameters in all."""
    if cap * layer_params.sum() < target:
        raise PlanError(
            f"layerwise: even at the per-layer maximum {cap:.3f} the layers hold only "
            f"{cap * layer_params.sum():.0f} of the {target:.0f} parameters to remove; raise layerwise_max_ratio"
        )
    mean = importance.mean()
    with np.errstate(divide="ignore"):
        weight = np.ones_like(importance) if mean <= 0 else mean / importance  # I_l = 0 -> inf -> the cap
    def removed(c: float) -> float:
        return float((np.minimum(cap, c * weight) * layer_params).sum())
    low, high = 0.0, 1.0
    while removed(high) < target:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if removed(mid) < target else (low, mid)
    return np.minimum(cap, high * weight)


def plan_layerwise(scores: GroupScores, layout: ModelLayout, options: PlanOptions) -> PrunePlan:
    scores.check_matches(layout)
    cap = options.layerwise_max_ratio
    target = target_params(layout, options.sparsity)
    layer_params = np.array(layout.layer_params, dtype=np.float64)
    ratios = allocate_layer_ratios(layer_importance(scores, layout, options.attention), layer_params, target, cap)

    left = {"attn": list(layout.attn_groups), "mlp": list(layout.mlp_channels)}
    removed = {"attn": [set() for _ in left["attn"]], "mlp": [set() for _ in left["mlp"]]}
    layer_removed = [0] * layout.num_layers

    def take(layer: int, index: int, kind: str, limit: float) -> None:
        size = layout.group_params(kind)
        if left[kind][layer] == 1 or layer_removed[layer] + size > limit or index in removed[kind][layer]:
            return
        left[kind][layer] -= 1
        removed[kind][layer].add(index)
        layer_removed[layer] += size

    for layer in range(layout.num_layers):
        budget = ratios[layer] * layer_params[layer]
        for _, _, index, kind in ranked_groups(scores, [layer], kinds(options)):
            take(layer, index, kind, budget)
    for _, layer, index, kind in ranked_groups(scores, kinds=kinds(options)):
        if sum(layer_removed) >= target:
            break
        take(layer, index, kind, cap * layer_params[layer])
    if sum(layer_removed) < target:
        raise PlanError(
            f"layerwise: cannot remove {target:.0f} parameters with at most {cap:.3f} of each layer "
            "without emptying a block; raise layerwise_max_ratio or lower the sparsity"
        )
    return plan_from_sets("layerwise", removed["attn"], removed["mlp"])


METHOD = Method("layerwise", Scoring.CRITERION, plan_layerwise)
