"""What depth pruning ranks layers by: one forward pass over the calibration rows, hooks on every decoder layer
reading its input and output hidden states (float32 statistics). See pruning/depth.py for the criteria."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from taylor_tune.pruning.depth import LayerSimilarity
from taylor_tune.pruning.groups import decoder_layers
from taylor_tune.sources.streaming import Kept, forward_layers, is_stream


def _hidden(value) -> torch.Tensor:
    return value[0] if isinstance(value, tuple) else value


@torch.no_grad()
def layer_similarity(model, ids: torch.Tensor, micro_batch_size: int = 8) -> LayerSimilarity:
    """One forward pass over the calibration rows `ids` ([rows, seq_len]), hooks on each decoder layer reading its
    input and output hidden states; a model held layer by layer (`sources.streaming`) is read as each layer's
    micro-batches go through it, layer-major, in the same order: the same measure."""
    streamed = is_stream(model)
    layers = model.num_layers if streamed else len(decoder_layers(model))
    sums = torch.zeros(layers, dtype=torch.float64)
    last: list[list[torch.Tensor]] = [[] for _ in range(layers + 1)]

    def record(index: int, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.float(), _hidden(y).float()
        sums[index] += torch.nn.functional.cosine_similarity(x, y, dim=-1).double().sum().cpu()
        if index == 0:
            last[0].append(x[:, -1].cpu())
        last[index + 1].append(y[:, -1].cpu())

    batches = ids.split(micro_batch_size)
    if streamed:
        @contextlib.contextmanager
        def watch(index, layer):
            yield lambda part, x, y: record(index, x, y)

        forward_layers(model, [{"input_ids": batch.to(model.device)} for batch in batches], Kept(), watch=watch)
    else:
        _hooked_pass(model, batches, record)
    tokens = sum(batch.numel() for batch in batches)
    return LayerSimilarity((sums / tokens).numpy(), torch.stack([torch.cat(t) for t in last]).numpy())


def _hooked_pass(model: nn.Module, batches, record) -> None:
    """The batches through the loaded model, each decoder layer's input and output handed to `record`."""
    def hook(index: int):
        return lambda module, args, kwargs, output: record(index, args[0] if args else kwargs["hidden_states"],
                                                           output)

    device = next(model.parameters()).device
    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(decoder_layers(model))]
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            model(input_ids=batch.to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
