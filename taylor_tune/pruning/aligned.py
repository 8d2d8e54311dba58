"""The aligned free layout (`align`): each layer keeps its own MLP width, as the method chose it, rounded to a multiple
of `align` (the matrix kernels' tiles: 64, 128, 256), so that the per-layer widths run as fast as the uniform ones.

The rounding is by importance, not by position: a layer whose width rounds down loses the channels it kept with the
lowest scores; one that rounds up takes back the removed channels with the highest. Each layer rounds to the nearest
multiple (ties: the wider), so the parameters removed stay within half an `align` block per layer of the method's
plan. A layer the method left whole stays whole, whatever its width; no layer keeps fewer than `align` channels
(an MLP with none would need a no-op block, which the pruned model does not have). Attention groups are whole KV
groups already and are left as the method chose them. Pure numpy, as the planners.
"""

from __future__ import annotations

import numpy as np

from taylor_tune.errors import PlanError
from taylor_tune.pruning.plan import GroupScores, ModelLayout, PrunePlan


def aligned_width(kept: int, channels: int, align: int, setting: str = "align") -> int:
    """The width a layer that keeps `kept` of its `channels` MLP channels keeps once aligned: the nearest multiple of
    `align` in [align, channels] (ties: the wider), or `channels` itself where nothing was removed. PlanError where
    `align` is not narrower than the MLP."""
    if kept == channels:
        return channels
    if align >= channels:  # equal: the only multiple is the whole MLP, so no layer could be pruned
        raise PlanError(f"{setting}: {align} is not narrower than the model's MLP ({channels} channels), so no "
                        "width could be pruned")
    down = max(align, kept // align * align)
    up = down + align
    return up if up <= channels and up - kept <= kept - down else down


def aligned_plan(plan: PrunePlan, scores: GroupScores, layout: ModelLayout, align: int,
                 setting: str = "align") -> PrunePlan:
    """`plan` with every layer's MLP width aligned (module docstring); ties in score: the lower index goes first, as
    in the global ranking. `setting`: the name an error gives (align, or servable's tile)."""
    scores.check_matches(layout)
    mlp = []
    for layer, removed in enumerate(plan.mlp_removed):
        channels = layout.mlp_channels[layer]
        gone = np.zeros(channels, dtype=bool)
        gone[list(removed)] = True
        width = aligned_width(channels - int(gone.sum()), channels, align, setting)
        order = scores.mlp[layer].argsort(kind="stable")  # least important first
        change = width - (channels - int(gone.sum()))
        if change < 0:  # the kept channels with the lowest scores go
            gone[[c for c in order if not gone[c]][:-change]] = True
        elif change > 0:  # the removed channels with the highest scores come back
            gone[[c for c in order[::-1] if gone[c]][:change]] = False
        mlp.append(tuple(np.flatnonzero(gone).tolist()))
    return PrunePlan(plan.method, plan.attn_removed, tuple(mlp), plan.layers_removed)
