"""random (baseline): global ranking of seeded uniform scores; the floor any real criterion must beat."""

import numpy as np

from taylor_tune.pruning.methods._base import Method, PlanOptions, plan_global
from taylor_tune.pruning.plan import GroupScores, ModelLayout, PrunePlan


def plan_random(scores: GroupScores | None, layout: ModelLayout, options: PlanOptions) -> PrunePlan:
    rng = np.random.default_rng(options.seed)
    drawn = GroupScores(
        attn=tuple(rng.random(n) for n in layout.attn_groups),
        mlp=tuple(rng.random(n) for n in layout.mlp_channels),
    )
    return plan_global("random", drawn, layout, options.sparsity)


METHOD = Method("random", "none", plan_random, "global ranking of seeded random scores")
