"""What every method shares: its options, its registry entry, and the global greedy removal."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from taylor_tune.config import PruneConfig
from taylor_tune.errors import PlanError
from taylor_tune.pruning.plan import GroupScores, ModelLayout, PrunePlan, plan_from_sets, ranked_groups, target_params


@dataclass(frozen=True)
class PlanOptions:
    """What a planner reads of a PruneConfig (`PlanOptions.of`; the defaults are the config's), its defaults
    resolved."""

    sparsity: float
    layerwise_max_ratio: float  # resolved: PruneConfig.layerwise_cap
    blockwise_layer_start: int | None
    blockwise_layer_end: int | None
    blockwise_attention: str
    criterion: str
    seed: int
    depth_criterion: str = "block_influence"
    attention: bool = True  # whether attention groups may go (the servable layout keeps them: MLP channels only)
    expert_sparsity: float = 0.0  # experts: the share of each sparse layer's experts that goes
    # the calibration loss of the model pruned by a candidate plan (blockwise_attention measured_loss); the caller
    # that holds the model provides it, so that planners stay pure
    plan_loss: Callable[[PrunePlan], float] | None = field(default=None, compare=False)

    @classmethod
    def of(cls, config: PruneConfig, plan_loss: Callable[[PrunePlan], float] | None = None) -> PlanOptions:
        return cls(sparsity=config.sparsity, layerwise_max_ratio=config.layerwise_cap,
                   blockwise_layer_start=config.blockwise_layer_start, blockwise_layer_end=config.blockwise_layer_end,
                   blockwise_attention=config.blockwise_attention, criterion=config.criterion, seed=config.seed,
                   depth_criterion=config.depth_criterion, attention=not config.servable,
                   expert_sparsity=config.expert_sparsity, plan_loss=plan_loss)


def kinds(options: PlanOptions) -> tuple[str, ...]:
    """The kinds of group a plan may remove."""
    return ("attn", "mlp") if options.attention else ("mlp",)


Planner = Callable[[GroupScores | None, ModelLayout, PlanOptions], PrunePlan]  # depth's: a LayerSimilarity


class Scoring(enum.Enum):
    """What a method's planner ranks."""

    CRITERION = "criterion"  # PruneConfig.criterion's scores: a gradient pass, or weight magnitude for l1/l2
    WEIGHTS = "weights"  # weight magnitude whatever the criterion
    NONE = "none"  # nothing: the planner draws its own
    LAYERS = "layers"  # whole layers (depth): the hidden states of a forward pass, or nothing for depth's `last`
    EXPERTS = "experts"  # a mixture's experts: their routing over the calibration tokens, or a gradient pass


@dataclass(frozen=True)
class Method:
    name: str
    scored_by: Scoring
    plan: Planner


def plan_global(method: str, scores: GroupScores, layout: ModelLayout, options: PlanOptions) -> PrunePlan:
    """Remove the least important groups of the whole model, in one ranking, until the target is reached.

    The last group of a block is never removed (a block needs one to run); it is skipped, not fatal.
    Stops at the first removal that reaches the target, so the overshoot is under one group. Without
    `options.attention`, the ranking holds the MLP channels alone.
    """
    sparsity = options.sparsity
    scores.check_matches(layout)
    target = target_params(layout, sparsity)
    left = {"attn": list(layout.attn_groups), "mlp": list(layout.mlp_channels)}
    removed = {"attn": [set() for _ in left["attn"]], "mlp": [set() for _ in left["mlp"]]}
    total = 0
    for _, layer, index, kind in ranked_groups(scores, kinds=kinds(options)):
        if total >= target:
            break
        if left[kind][layer] == 1:
            continue
        left[kind][layer] -= 1
        removed[kind][layer].add(index)
        total += layout.group_params(kind)
    if total < target:
        raise PlanError(
            f"{method}: cannot remove {target:.0f} parameters without emptying a block "
            f"(at most {total} removable); lower the sparsity"
        )
    return plan_from_sets(method, removed["attn"], removed["mlp"])
