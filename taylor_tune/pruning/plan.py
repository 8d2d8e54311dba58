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
    # a mixture of experts: each layer's experts (0 for a dense layer), one expert's parameters (its weights and its
    # router row), and how many experts a token is routed to; a dense model has none
    experts: tuple[int, ...] = ()
    expert_params: int = 0
    top_k: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.attn_groups)

    @property
    def active_params(self) -> int:
        """The parameters one token computes with: all but the experts it is not routed to."""
        return self.total_params - sum(max(0, e - self.top_k) for e in self.experts) * self.expert_params

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
    experts_removed: tuple[tuple[int, ...], ...] = ()  # per layer, a mixture's experts that go (none: no experts)

    def experts_gone(self, layout: ModelLayout) -> tuple[tuple[int, ...], ...]:
        """The experts each layer loses, a layer without experts (or a plan that removes none) losing none."""
        return self.experts_removed or ((),) * layout.num_layers

    def experts_kept(self, layout: ModelLayout) -> list[list[int]]:
        """The experts each layer keeps, by their index in the unpruned model (none for a dense layer)."""
        return [[e for e in range(count) if e not in gone]
                for count, gone in zip(layout.experts, self.experts_gone(layout))]

    def layer_params_removed(self, layout: ModelLayout) -> list[int]:
        experts = self.experts_gone(layout)
        return [
            layout.layer_params[layer] if layer in self.layers_removed
            else len(a) * layout.attn_group_params + len(m) * layout.mlp_channel_params + len(e) * layout.expert_params
            for layer, (a, m, e) in enumerate(zip(self.attn_removed, self.mlp_removed, experts))
        ]

    def active_params_after(self, layout: ModelLayout) -> int:
        """`ModelLayout.active_params` of the pruned model: its experts' count less the removed, a token's top-k
        the same."""
        removed = sum(self.layer_params_removed(layout))
        if not layout.experts:
            return layout.total_params - removed
        idle = sum(max(0, len(kept) - layout.top_k) for kept in self.experts_kept(layout))
        return layout.total_params - removed - idle * layout.expert_params

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
                if len(removed) >= size and (size or removed):
                    raise PlanError(
                        f"layer {layer}: the plan would empty the {kind} block ({len(removed)} of {size} groups)"
                    )
        self._validate_experts(layout)

    def _validate_experts(self, layout: ModelLayout) -> None:
        """A mixture keeps at least its top-k experts in every sparse layer (a token is routed to that many)."""
        if not self.experts_removed:
            return
        if len(self.experts_removed) != layout.num_layers or not layout.experts:
            raise PlanError(f"plan removes experts of {len(self.experts_removed)} layers, the model has "
                            f"{len(layout.experts)} layers of experts")
        for layer, (removed, size) in enumerate(zip(self.experts_removed, layout.experts)):
            if len(set(removed)) != len(removed) or any(not 0 <= i < size for i in removed):
                raise PlanError(f"layer {layer}: expert indices must be unique and in [0, {size})")
            if removed and size - len(removed) < layout.top_k:
                raise PlanError(f"layer {layer}: the plan keeps {size - len(removed)} of {size} experts, fewer than "
                                f"the {layout.top_k} each token is routed to")


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
