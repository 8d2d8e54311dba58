"""depth: whole decoder layers, as many as come nearest the target, chosen by `depth_criterion`
(pruning/depth.py: block influence, angular distance, or the last ones)."""

from taylor_tune.pruning.depth import LayerSimilarity, choose_layers, layers_to_remove
from taylor_tune.pruning.methods._base import Method, PlanOptions, Scoring
from taylor_tune.pruning.plan import ModelLayout, PrunePlan


def plan_depth(similarity: LayerSimilarity | None, layout: ModelLayout, options: PlanOptions) -> PrunePlan:
    n = layers_to_remove(layout, options.sparsity)
    none = tuple(() for _ in range(layout.num_layers))
    return PrunePlan("depth", none, none, choose_layers(options.depth_criterion, n, layout.num_layers, similarity))


METHOD = Method("depth", Scoring.LAYERS, plan_depth)
