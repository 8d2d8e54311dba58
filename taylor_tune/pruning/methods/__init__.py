"""The registry of pruning methods, one small file each: what the method ranks (`Scoring`) and a pure planner.

Planners take (scores, layout, options) and return a PrunePlan; they never touch a model. The names are
`config.METHODS` (validated without importing a planner); a method is added here and there, and a test holds the
two equal.
"""

from taylor_tune.pruning.methods import blockwise, depth, experts, layerwise, magnitude, random, taylor
from taylor_tune.pruning.methods._base import Method, Planner, PlanOptions, Scoring, plan_global

METHODS: dict[str, Method] = {m.METHOD.name: m.METHOD for m in (taylor, layerwise, blockwise, magnitude, random,
                                                                  depth, experts)}
# The methods that remove groups within layers (all but depth, which removes whole layers, and experts)
WIDTH_METHODS = tuple(name for name, m in METHODS.items() if m.scored_by not in (Scoring.LAYERS, Scoring.EXPERTS))

__all__ = ["METHODS", "WIDTH_METHODS", "Method", "PlanOptions", "Planner", "Scoring", "plan_global"]
