"""depth: whole decoder layers, as many as come nearest the target, chosen by `depth_criterion`
(pruning/depth.py: block influence, angular distance, whole-layer Taylor importance, measured loss, or the last
ones)."""

import numpy as np

from taylor_tune.pruning.depth import (
    LayerSimilarity,
    choose_layers,
    depth_plan,
    greedy_by_loss,
    layer_taylor,
    layers_to_remove,
)
from taylor_tune.pruning.methods._base import Method, PlanOptions, Scoring
from taylor_tune.pruning.plan import GroupScores, ModelLayout, PrunePlan


def plan_depth(scores: LayerSimilarity | GroupScores | None, layout: ModelLayout, options: PlanOptions) -> PrunePlan:
    """`scores`: the hidden states' similarity (block_influence, angular), the gradient's group scores (taylor), or
    nothing (measured_loss measures through options.plan_loss; last measures nothing)."""
    n, criterion = layers_to_remove(layout, options.sparsity), options.depth_criterion
    if criterion == "taylor":
        values = layer_taylor(scores, layout)
        return depth_plan(layout, np.lexsort((np.arange(len(values)), values))[:n].tolist())
    if criterion == "measured_loss":
        if options.plan_loss is None:
            raise ValueError("depth_criterion measured_loss needs the model's calibration loss (PlanOptions.plan_loss)")
        return depth_plan(layout, greedy_by_loss(n, layout, options.plan_loss))
    return depth_plan(layout, choose_layers(criterion, n, layout.num_layers, scores))


METHOD = Method("depth", Scoring.LAYERS, plan_depth)
