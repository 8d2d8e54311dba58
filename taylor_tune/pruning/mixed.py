"""Mixed cuts: a share of the target taken as whole layers (depth), the rest by a width method on the layers that
stay. Pure numpy, as the planners.

`depth_share` of the target (sparsity x total parameters) goes as whole layers: the count nearest that share (at
least one), chosen by `depth_criterion` on the whole model. The width method then plans on the model without those
layers (its layout, scores and blockwise range re-indexed to the layers that stay) for what remains of the target,
made uniform if asked (every remaining layer one shape: a stock model); its plan is mapped back to the original
layer indices beside the removed layers.
"""

from __future__ import annotations

from collections.abc import Callable

from taylor_tune.errors import PlanError
from taylor_tune.pruning.plan import GroupScores, ModelLayout, PrunePlan, target_params


def without_layers(layout: ModelLayout, removed: tuple[int, ...]) -> ModelLayout:
    """The layout of the model with the layers `removed` gone."""
    kept = [i for i in range(layout.num_layers) if i not in removed]
    return ModelLayout(attn_groups=tuple(layout.attn_groups[i] for i in kept),
                       mlp_channels=tuple(layout.mlp_channels[i] for i in kept),
                       attn_group_params=layout.attn_group_params, mlp_channel_params=layout.mlp_channel_params,
                       layer_params=tuple(layout.layer_params[i] for i in kept),
                       total_params=layout.total_params - sum(layout.layer_params[i] for i in removed))


def kept_scores(scores: GroupScores | None, kept: list[int]) -> GroupScores | None:
    return None if scores is None else GroupScores(attn=tuple(scores.attn[i] for i in kept),
                                                   mlp=tuple(scores.mlp[i] for i in kept))


def mapped_back(plan: PrunePlan, removed: tuple[int, ...], num_layers: int, method: str) -> PrunePlan:
    """A plan of the layers that stay, on the original layer indices, with the whole layers `removed`."""
    attn, mlp, parts = [], [], iter(zip(plan.attn_removed, plan.mlp_removed))
    for layer in range(num_layers):
        a, m = ((), ()) if layer in removed else next(parts)
        attn.append(a)
        mlp.append(m)
    return PrunePlan(method, tuple(attn), tuple(mlp), tuple(sorted(removed)))


def reindexed(index: int | None, removed: tuple[int, ...]) -> int | None:
    """An original layer index (a blockwise bound) as an index among the layers that stay."""
    return None if index is None else index - sum(i < index for i in removed)


def mixed_plan(removed: tuple[int, ...], layout: ModelLayout, sparsity: float,
               width: Callable[[ModelLayout, float, Callable[[PrunePlan], PrunePlan]], PrunePlan],
               method: str) -> PrunePlan:
    """The width part on the layers that stay, for the rest of the target, mapped back beside `removed`.
    `width(reduced_layout, sparsity_there, to_full)` plans the width part; `to_full` maps one of its candidate plans
    to the whole model (for a measured loss)."""
    reduced = without_layers(layout, removed)
    rest = target_params(layout, sparsity) - (layout.total_params - reduced.total_params)
    if rest <= 0:  # the layers alone reach the target
        none = tuple(() for _ in range(reduced.num_layers))
        return mapped_back(PrunePlan(method, none, none), removed, layout.num_layers, method)
    if rest >= reduced.total_params:
        raise PlanError(f"depth_share: the width part cannot remove {rest:.0f} parameters from what stays")
    plan = width(reduced, rest / reduced.total_params,
                 lambda candidate: mapped_back(candidate, removed, layout.num_layers, method))
    return mapped_back(plan, removed, layout.num_layers, method)
