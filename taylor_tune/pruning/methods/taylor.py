"""taylor: one global ranking of every group of every layer; per-layer ratios emerge freely."""

from taylor_tune.pruning.methods._base import Method, PlanOptions, Scoring, plan_global
from taylor_tune.pruning.plan import GroupScores, ModelLayout, PrunePlan


def plan_taylor(scores: GroupScores, layout: ModelLayout, options: PlanOptions) -> PrunePlan:
    return plan_global("taylor", scores, layout, options)


METHOD = Method("taylor", Scoring.CRITERION, plan_taylor)
