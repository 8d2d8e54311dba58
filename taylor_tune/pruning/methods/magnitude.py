"""magnitude (baseline): global ranking of each group's mean squared weight; no gradients, no calibration."""

from taylor_tune.pruning.methods._base import Method, PlanOptions, Scoring, plan_global
from taylor_tune.pruning.plan import GroupScores, ModelLayout, PrunePlan


def plan_magnitude(scores: GroupScores, layout: ModelLayout, options: PlanOptions) -> PrunePlan:
    return plan_global("magnitude", scores, layout, options)


METHOD = Method("magnitude", Scoring.WEIGHTS, plan_magnitude)
