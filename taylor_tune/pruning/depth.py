"""Depth pruning: which whole decoder layers to remove, and removing them so the model stays a stock one.

How many layers: the target is a fraction of the model's total parameters, as for width; a layer count that cannot
meet it exactly is rounded to the nearest count (a tie rounds down), at least one layer and never the last one
standing; the ratio reached is what the diagnostics report. Which layers, by `depth_criterion`:

- `block_influence` (ShortGPT, Men et al. 2024): BI_l = 1 - mean over calibration tokens of cos(x_l, x_{l+1}), the
  cosine between layer l's input and output hidden states; the n layers of lowest BI go.
- `angular` (Gromov et al. 2024): d_l(n) = mean over calibration rows of arccos(cos(x_l, x_{l+n})) / pi at the last
  token; the block of n consecutive layers starting where d is smallest goes.
- `last`: the n layers before the final one (the baseline the layer-removal papers report).

`layer_similarity` measures what the first two rank in one forward pass (float32 statistics); `choose_layers` is
pure; `remove_layers` removes them in place: the decoder's ModuleList, each attention's `layer_idx` (the KV cache's
index), `num_hidden_layers` and every per-layer list of the config (`layer_types`) cut to match, so that
`save_pretrained` writes a stock config that plain `AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from taylor_tune.errors import PlanError
from taylor_tune.pruning.groups import decoder_layers
from taylor_tune.pruning.plan import ModelLayout, target_params

DEPTH_CRITERIA = ("block_influence", "angular", "last")


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


def _hidden(value) -> torch.Tensor:
    return value[0] if isinstance(value, tuple) else value


@torch.no_grad()
def layer_similarity(model: nn.Module, ids: torch.Tensor, micro_batch_size: int = 8) -> LayerSimilarity:
    """One forward pass over the calibration rows `ids` ([rows, seq_len]), hooks on each decoder layer reading its
    input and output hidden states."""
    layers = decoder_layers(model)
    device = next(model.parameters()).device
    sums = torch.zeros(len(layers), dtype=torch.float64)
    tokens = 0
    last: list[list[torch.Tensor]] = [[] for _ in range(len(layers) + 1)]

    def hook(index: int):
        def record(module, args, kwargs, output):
            x = (args[0] if args else kwargs["hidden_states"]).float()
            y = _hidden(output).float()
            sums[index] += torch.nn.functional.cosine_similarity(x, y, dim=-1).double().sum().cpu()
            if index == 0:
                last[0].append(x[:, -1].cpu())
            last[index + 1].append(y[:, -1].cpu())
        return record

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    was_training = model.training
    model.eval()
    try:
        for batch in ids.split(micro_batch_size):
            model(input_ids=batch.to(device), use_cache=False)
            tokens += batch.numel()
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return LayerSimilarity((sums / tokens).numpy(), torch.stack([torch.cat(t) for t in last]).numpy())


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


def remove_layers(model: nn.Module, removed: tuple[int, ...]) -> nn.Module:
    """Remove the decoder layers `removed` from `model` in place (see the module docstring) and return it."""
    layers = decoder_layers(model)
    total = len(layers)
    if not removed or len(set(removed)) != len(removed) or not all(0 <= i < total for i in removed) \
            or len(removed) >= total:
        raise PlanError(f"depth: cannot remove layers {list(removed)} of {total}")
    kept = [i for i in range(total) if i not in set(removed)]
    parent = model.model if hasattr(model, "model") else model
    parent.layers = nn.ModuleList(layers[i] for i in kept)
    for index, layer in enumerate(parent.layers):
        layer.self_attn.layer_idx = index
    config = model.config
    for key, value in list(config.to_diff_dict().items()) + [("layer_types", getattr(config, "layer_types", None))]:
        if isinstance(value, (list, tuple)) and len(value) == total and key != "architectures":
            setattr(config, key, [value[i] for i in kept])
    config.num_hidden_layers = len(kept)
    return model
