"""experts: a mixture's experts, the same count from every sparse layer (`expert_sparsity` of each layer's experts, to
the nearest, at least one), the lowest-scored by `expert_criterion` (pruning/experts.py); ties go by index. The same
count everywhere keeps the model stock: a mixture's config holds one expert count for all its layers."""

import numpy as np

from taylor_tune.errors import PlanError
from taylor_tune.pruning.methods._base import Method, PlanOptions, Scoring
from taylor_tune.pruning.plan import ModelLayout, PrunePlan


def plan_experts(scores, layout: ModelLayout, options: PlanOptions) -> PrunePlan:
    """`scores`: per layer, one score per expert (an empty array for a dense layer)."""
    if not layout.experts:
        raise PlanError("experts: the model has no experts; it is dense, which the width and depth methods prune")
    removed = []
    for layer, size in enumerate(layout.experts):
        if not size:
            removed.append(())
            continue
        values = np.asarray(scores[layer], dtype=np.float64)
        if len(values) != size:
            raise PlanError(f"experts: layer {layer} has {size} experts but {len(values)} scores")
        count = max(1, round(options.expert_sparsity * size))
        if size - count < layout.top_k:
            raise PlanError(f"expert_sparsity: {options.expert_sparsity} removes {count} of {size} experts, leaving "
                            f"fewer than the {layout.top_k} each token is routed to; at most "
                            f"{(size - layout.top_k) / size:g}")
        removed.append(tuple(sorted(np.lexsort((np.arange(size), values))[:count].tolist())))
    none = ((),) * layout.num_layers
    return PrunePlan("experts", none, none, experts_removed=tuple(removed))


METHOD = Method("experts", Scoring.EXPERTS, plan_experts)
