"""What depth pruning ranks layers by: one forward pass over the calibration rows, hooks on every decoder layer
reading its input and output hidden states (float32 statistics). See pruning/depth.py for the criteria."""

from __future__ import annotations

import torch
from torch import nn

from taylor_tune.pruning.depth import LayerSimilarity
from taylor_tune.pruning.groups import decoder_layers


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
