"""The pure vocabulary of pruning: what a model's groups look like, their scores, and a plan to remove some.

No torch here: methods turn (GroupScores, ModelLayout) into a PrunePlan with numpy alone, so planning is
testable on hand-built scores and cheap to run in a search driver.

Groups (docs/specification.md §1): layer l has `attn_groups[l]` attention groups (one key/value head with the query
heads
that share it) and `mlp_channels[l]` MLP channels (one row of gate/up, one column of down).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from taylor_tune.errors import PlanError


@dataclass(frozen=True)
class ModelLayout:
    """Group structure and parameter counts of an (unpruned) decoder model."""

    attn_groups: tuple[int, ...]  # attention groups per layer
    mlp_channels: tuple[int, ...]  # MLP channels per layer
    attn_group_params: int  # parameters in one attention group (weights and biases)
    mlp_channel_params: int  # parameters in one MLP channel
    layer_params: tuple[int, ...]  # all parameters of each decoder layer, norms included
    total_params: int  # the whole model: embeddings, lm_head, norms, layers

    @property
    def num_layers(self) -> int:
        return len(self.attn_groups)

    def group_params(self, kind: str) -> int:
        return self.attn_group_params if kind == "attn" else self.mlp_channel_params


@dataclass(frozen=True)
class GroupScores:
    """One importance score per group: `attn[l][g]` and `mlp[l][c]` (higher = more important)."""

    attn: tuple[np.ndarray, ...]
    mlp: tuple[np.ndarray, ...]

    def check_matches(self, layout: ModelLayout) -> None:
        shapes = [len(a) for a in self.attn], [len(m) for m in self.mlp]
        if shapes != (list(layout.attn_groups), list(layout.mlp_channels)):
            raise PlanError(
                f"scores have {shapes} groups per layer but the model has {layout.attn_groups}, {layout.mlp_channels}"
            )


@dataclass(frozen=True)
class PrunePlan:
    """Which groups go: sorted indices per layer; and which whole layers go (depth), sorted."""

    method: str
    attn_removed: tuple[tuple[int, ...], ...]
    mlp_removed: tuple[tuple[int, ...], ...]
    layers_removed: tuple[int, ...] = ()

    def layer_params_removed(self, layout: ModelLayout) -> list[int]:
        return [
            layout.layer_params[layer] if layer in self.layers_removed
            else len(a) * layout.attn_group_params + len(m) * layout.mlp_channel_params
            for layer, (a, m) in enumerate(zip(self.attn_removed, self.mlp_removed))
        ]

    def params_removed(self, layout: ModelLayout) -> int:
        return sum(self.layer_params_removed(layout))

    def validate(self, layout: ModelLayout) -> None:
        """Indices in range and unique; no attention or MLP block emptied (a block needs one group to run)."""
        if len(self.attn_removed) != layout.num_layers or len(self.mlp_removed) != layout.num_layers:
            raise PlanError(f"plan covers {len(self.attn_removed)} layers, model has {layout.num_layers}")
        gone = self.layers_removed
        if len(set(gone)) != len(gone) or any(not 0 <= i < layout.num_layers for i in gone) \
                or len(gone) >= layout.num_layers:
            raise PlanError(f"whole layers removed {list(gone)} must be unique, in [0, {layout.num_layers}), and "
                            "leave one")
        if any(self.attn_removed[i] or self.mlp_removed[i] for i in gone):
            raise PlanError("a layer removed whole has no groups removed besides")
        for layer, (attn, mlp) in enumerate(zip(self.attn_removed, self.mlp_removed)):
            for kind, removed, size in (
                ("attention", attn, layout.attn_groups[layer]),
                ("MLP", mlp, layout.mlp_channels[layer]),
            ):
                if len(set(removed)) != len(removed) or any(not 0 <= i < size for i in removed):
                    raise PlanError(f"layer {layer}: {kind} indices must be unique and in [0, {size})")
                if len(removed) >= size:
                    raise PlanError(
                        f"layer {layer}: the plan would empty the {kind} block ({len(removed)} of {size} groups)"
                    )


def target_params(layout: ModelLayout, sparsity: float) -> float:
    """Parameters to remove: a fraction of the model's *total* count (embeddings included)."""
    return sparsity * layout.total_params


def plan_from_sets(method: str, attn: list[set[int]], mlp: list[set[int]]) -> PrunePlan:
    return PrunePlan(method, tuple(tuple(sorted(s)) for s in attn), tuple(tuple(sorted(s)) for s in mlp))


def ranked_groups(scores: GroupScores, layers: range | list[int] | None = None,
                  kinds: tuple[str, ...] = ("attn", "mlp")) -> list[tuple[float, int, int, str]]:
    """All groups of the given layers and kinds, least important first: (score, layer, index, kind).

    Ties break by layer, then attention before MLP, then index, so a plan is deterministic.
    """
    layers = range(len(scores.attn)) if layers is None else layers
    items = []
    for layer in layers:
        if "attn" in kinds:
            items += [(float(s), layer, 0, i) for i, s in enumerate(scores.attn[layer])]
        if "mlp" in kinds:
            items += [(float(s), layer, 1, i) for i, s in enumerate(scores.mlp[layer])]
    items.sort()
    return [(s, layer, i, "attn" if k == 0 else "mlp") for s, layer, k, i in items]
