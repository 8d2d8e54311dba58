"""The uniform layout: every decoder layer keeps the same number of attention groups and the same MLP width.

A model whose layers all have one shape is a stock model with smaller `num_attention_heads`,
`num_key_value_heads` and `intermediate_size`, which any runtime loads; uneven shapes also lose most of the
speed pruning buys (issue 28). Any method can produce it. How many attention groups every layer loses: with a
`plan_loss` (the caller holds the model), the count whose uniform plan has the lowest measured calibration loss,
one forward pass per candidate count (as blockwise's measured_loss; losing a whole KV group in every layer, the
first and last included, can wreck a model with 2 or 3 of them); without one, the method's mean per layer,
rounded. The MLP width is then what meets the target, rounded to a multiple (`multiple`, for the matrix units), and
inside each layer the method's own scores pick the groups that go. Pure numpy, as the planners.
"""

from __future__ import annotations

from collections.abc import Callable

from taylor_tune.errors import PlanError
from taylor_tune.pruning.plan import GroupScores, ModelLayout, PrunePlan, target_params


def _shape(layout: ModelLayout, multiple: int) -> tuple[int, int]:
    groups, channels = set(layout.attn_groups), set(layout.mlp_channels)
    if len(groups) != 1 or len(channels) != 1:
        raise PlanError("uniform: the model's layers differ in size (was it already pruned?)")
    g, c = groups.pop(), channels.pop()
    if multiple > c:
        raise PlanError(f"uniform_multiple: {multiple} is wider than the model's MLP ({c} channels)")
    return g, c


def mlp_width(layout: ModelLayout, sparsity: float, multiple: int, attn_removed: int) -> int | None:
    """The MLP width every layer keeps when each loses `attn_removed` attention groups: the multiple of `multiple`
    (or the full width) whose removal lands nearest the target (ties: the wider); None when even the narrowest
    width leaves the target further than half a multiple away."""
    _, c = _shape(layout, multiple)
    n = layout.num_layers
    mlp_budget = target_params(layout, sparsity) - n * attn_removed * layout.attn_group_params
    width = c - mlp_budget / (n * layout.mlp_channel_params)
    if width < multiple / 2:
        return None
    widths = sorted({*range(multiple, c + 1, multiple), c})
    return min(widths, key=lambda kept: (abs(kept - width), -kept))


def _plan(method: str, scores: GroupScores, keep_groups: int, keep_channels: int) -> PrunePlan:
    """Every layer keeps its `keep_groups` / `keep_channels` highest-scored groups (ties: the lower index goes, as
    in the global ranking)."""
    attn = tuple(tuple(sorted(s.argsort(kind="stable")[: len(s) - keep_groups].tolist())) for s in scores.attn)
    mlp = tuple(tuple(sorted(s.argsort(kind="stable")[: len(s) - keep_channels].tolist())) for s in scores.mlp)
    return PrunePlan(method, attn, mlp)


def uniform_plan(plan: PrunePlan, scores: GroupScores, layout: ModelLayout, sparsity: float, multiple: int,
                 plan_loss: Callable[[PrunePlan], float] | None = None) -> PrunePlan:
    """`plan` (the method's) made uniform, as the module docstring says. The sparsity reached differs from the
    target by the rounding of the width: the diagnostics report it."""
    scores.check_matches(layout)
    g, _ = _shape(layout, multiple)
    if plan_loss is None:
        counts = [min(g - 1, round(sum(len(a) for a in plan.attn_removed) / layout.num_layers))]
    else:
        counts = list(range(g))  # every attention count a layer can lose; ties: the fewer (min keeps the first)
    widths = {k: mlp_width(layout, sparsity, multiple, k) for k in counts}
    candidates = [_plan(plan.method, scores, g - k, width) for k, width in widths.items() if width is not None]
    if not candidates:
        raise PlanError(f"uniform: every layer would need to keep less than half of {multiple} MLP channels to reach "
                        f"sparsity {sparsity}; lower the sparsity or uniform_multiple")
    return candidates[0] if plan_loss is None else min(candidates, key=plan_loss)
