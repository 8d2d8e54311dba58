"""Depth pruning: which whole decoder layers to remove, and removing them so the model stays a stock one.

How many layers: the target is a fraction of the model's total parameters, as for width; a layer count that cannot
meet it exactly is rounded to the nearest count (a tie rounds down), at least one layer and never the last one
standing; the ratio reached is what the diagnostics report. Which layers, by `depth_criterion`:

- `block_influence` (ShortGPT, Men et al. 2024): BI_l = 1 - mean over calibration tokens of cos(x_l, x_{l+1}), the
  cosine between layer l's input and output hidden states; the n layers of lowest BI go.
- `angular` (Gromov et al. 2024): d_l(n) = mean over calibration rows of arccos(cos(x_l, x_{l+n})) / pi at the last
  token; the block of n consecutive layers starting where d is smallest goes.
- `taylor`: the layer's group-normalized first-order Taylor importance as a whole, sum over its groups of
  sum |w * g| divided by its groups' parameters (the width methods' gradient pass and cache); the n lowest go.
- `measured_loss`: greedy, n times: the layer whose removal (with those already chosen) gives the lowest
  calibration loss, measured with the layers skipped (`measured.masked`).
- `last`: the n layers before the final one (the baseline the layer-removal papers report).

Pure (numpy): `similarity.layer_similarity` measures what the first two rank in one forward pass (float32
statistics); `apply.remove_layers` removes the chosen layers so that the model stays a stock one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from taylor_tune.config import DEPTH_CRITERIA
from taylor_tune.errors import PlanError
from taylor_tune.pruning.plan import GroupScores, ModelLayout, PrunePlan, target_params


@dataclass(frozen=True)
class LayerSimilarity:
    """What the forward pass measured: per layer the mean cosine between its input and output over every token, and
    the last token's hidden state at each layer boundary (x_0 = the first layer's input ... x_L = the last's
    output), per calibration row."""

    cosine: np.ndarray  # [layers]
    last_token: np.ndarray  # [layers + 1, rows, hidden], float32

    @property
    def block_influence(self) -> np.ndarray:
        return 1.0 - self.cosine

    def angular_distance(self, n: int) -> np.ndarray:
        """d_l(n) for every start l in [0, layers - n]: mean over rows of arccos(cos(x_l, x_{l+n})) / pi."""
        x = self.last_token.astype(np.float64)
        a, b = x[: len(x) - n], x[n:]
        cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
        return (np.arccos(np.clip(cos, -1.0, 1.0)) / np.pi).mean(axis=1)


def layers_to_remove(layout: ModelLayout, sparsity: float) -> int:
    """The layer count whose parameters come nearest the target (ties: the smaller count); at least one, and one
    layer always stays. PlanError when even the nearest count would remove every layer."""
    target = target_params(layout, sparsity)
    sizes = sorted(layout.layer_params)  # a homogeneous decoder: all equal; else the count of the smallest layers
    removed = np.cumsum([0, *sizes])
    n = int(np.argmin(np.abs(removed - target)))  # argmin: the first (smaller) count of a tie
    if n >= layout.num_layers:
        raise PlanError(f"depth: sparsity {sparsity} would remove all {layout.num_layers} layers")
    return max(n, 1)


def choose_layers(criterion: str, n: int, num_layers: int, similarity: LayerSimilarity | None = None
                  ) -> tuple[int, ...]:
    """The n layers `criterion` removes, sorted; `similarity` is needed by block_influence and angular."""
    if not 0 < n < num_layers:
        raise PlanError(f"depth: cannot remove {n} of {num_layers} layers")
    if criterion == "last":
        return tuple(range(num_layers - 1 - n, num_layers - 1))
    if similarity is None:
        raise ValueError(f"depth_criterion {criterion} ranks layers by a forward pass (layer_similarity)")
    if criterion == "block_influence":
        order = sorted(range(num_layers), key=lambda i: (similarity.block_influence[i], i))  # ties: the earlier
        return tuple(sorted(order[:n]))
    if criterion == "angular":
        start = int(np.argmin(similarity.angular_distance(n)))
        return tuple(range(start, start + n))
    raise ValueError(f"unknown depth_criterion {criterion!r}; allowed: {', '.join(DEPTH_CRITERIA)}")


def layer_taylor(scores: GroupScores, layout: ModelLayout) -> np.ndarray:
    """Each layer's group-normalized Taylor importance as a whole: the scores are per-parameter (sum |w * g| over a
    group divided by its size), so they are weighted back by the group sizes and divided by the layer's."""
    a, m = layout.attn_group_params, layout.mlp_channel_params
    return np.array([(att.sum() * a + mlp.sum() * m) / (len(att) * a + len(mlp) * m)
                     for att, mlp in zip(scores.attn, scores.mlp)])


def depth_plan(layout: ModelLayout, removed) -> PrunePlan:
    none = tuple(() for _ in range(layout.num_layers))
    return PrunePlan("depth", none, none, tuple(sorted(removed)))


def greedy_by_loss(n: int, layout: ModelLayout, loss) -> tuple[int, ...]:
    """n times, the layer whose removal with those already chosen gives the lowest `loss(plan)` (ties: the earlier
    layer)."""
    removed: list[int] = []
    for _ in range(n):
        left = [c for c in range(layout.num_layers) if c not in removed]
        removed.append(min(left, key=lambda c: (loss(depth_plan(layout, [*removed, c])), c)))
    return tuple(sorted(removed))
