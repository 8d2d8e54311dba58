"""Registry of pruning methods. A method is one small file: a scoring criterion plus a pure planner.

Planners take (scores, layout, options) and return a PrunePlan; they never touch a model.
"""

from taylor_tune.pruning.methods import blockwise, layerwise, magnitude, random, taylor
from taylor_tune.pruning.methods._base import DEFAULT_BLOCKWISE_ATTENTION, Method, Planner, PlanOptions, plan_global

METHODS: dict[str, Method] = {m.METHOD.name: m.METHOD for m in (taylor, layerwise, blockwise, magnitude, random)}

__all__ = ["DEFAULT_BLOCKWISE_ATTENTION", "METHODS", "Method", "PlanOptions", "Planner", "plan_global"]
