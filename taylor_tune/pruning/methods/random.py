"""random (baseline): global ranking of seeded uniform scores; the floor any real criterion must beat."""

import numpy as np

from taylor_tune.pruning.methods._base import Method, PlanOptions, Scoring, plan_global
from taylor_tune.pruning.plan import GroupScores, ModelLayout, PrunePlan


def drawn_scores(layout: ModelLayout, seed: int) -> GroupScores:
    """The seeded scores the random method ranks by (its uniform layout picks by them too)."""
    rng = np.random.default_rng(seed)
    return GroupScores(attn=tuple(rng.random(n) for n in layout.attn_groups),
                       mlp=tuple(rng.random(n) for n in layout.mlp_channels))


def plan_random(scores: GroupScores | None, layout: ModelLayout, options: PlanOptions) -> PrunePlan:
    return plan_global("random", drawn_scores(layout, options.seed), layout, options)


METHOD = Method("random", Scoring.NONE, plan_random)
