"""The gradient pass taken layer-major (issue 92): the same Taylor importance as
`importance.compute_importance`, to float rounding, while the device holds one layer's gradient buffers.

ḡ is a sum over the calibration sequences, so it can be taken one decoder layer at a time. A forward pass without
gradients keeps each layer's input for every micro-batch (and what the layer was called with: positions, masks),
and the last layer's output. The head (final norm, lm_head, the loss as the model computes it) gives the gradient of
Σ over samples of each sample's mean token loss with respect to that output. Then, from the last layer to the first,
each micro-batch's kept input goes through the layer again with gradients on, the output's gradient flows back
through it alone, the layer's prunable parameters accumulate ḡ in fp32 buffers the size of that layer, and the
input's gradient becomes the output gradient of the layer below. At each sample count in `snapshots` the layer's
group sums and gradient statistics are taken, as the in-memory pass takes them for every layer at once.

What lives where: the kept activations and gradients (per micro-batch, every layer's input, and the gradient flowing
down) on the host or in a scratch folder (`sources.streaming.Kept`); one layer's weights and buffers on the device,
beside the head. The layers come from a loaded model (`Resident`) or are read from the checkpoint one at a time
(`Checkpoint`): one code path, so the two agree by construction and the tests hold them to the in-memory pass.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from taylor_tune.pruning.groups import layer_parameters, sliced_norms
from taylor_tune.pruning.importance import Importance, assembled, layer_snapshot, sample_counts
from taylor_tune.pruning.plan import ModelLayout
from taylor_tune.sources.streaming import Checkpoint, Kept, Resident, forward_layers, head_logits, hidden_of


def spans(total: int, counts: list[int], micro_batch_size: int) -> list[tuple[int, int]]:
    """The micro-batches (start, end) of the in-memory pass: `micro_batch_size` rows, never across a snapshot."""
    out, done = [], 0
    for boundary in counts:
        while done < boundary:
            out.append((done, min(done + micro_batch_size, boundary)))
            done = out[-1][1]
    return out


def head_loss(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The model's causal-LM loss from its last decoder layer's output, as its own forward computes it
    (`sources.streaming.head_logits`, then the model's loss function)."""
    return model.loss_function(logits=head_logits(model, hidden), labels=labels, vocab_size=model.config.vocab_size)


def compute_importance_streamed(model: nn.Module | Resident | Checkpoint, layout: ModelLayout,
                                input_ids: torch.Tensor, *, micro_batch_size: int = 8,
                                snapshots: list[int] | None = None,
                                scratch: Path | None = None) -> dict[int, Importance]:
    """`importance.compute_importance`, layer-major (the module's docstring): the same arguments and results. `model`
    is a loaded model or a stream of one's layers (`sources.streaming`); `scratch`: a folder for what the pass keeps
    between layers, instead of the host's memory (default: the stream's own `scratch`). A loaded model's
    requires_grad flags and mode are restored."""
    stream = Resident(model) if isinstance(model, nn.Module) else model
    model = stream.model
    total = input_ids.shape[0]
    counts = sample_counts(total, snapshots)
    parts = spans(total, counts, micro_batch_size)
    flags = {p: p.requires_grad for p in model.parameters()}
    was_training = model.training
    taken: dict[int, list] = {n: [] for n in counts}
    kept, last = Kept(scratch or getattr(stream, "scratch", None)), stream.num_layers
    try:
        model.requires_grad_(False)
        model.eval()  # dropout off, as the in-memory pass
        calls = forward_layers(stream, [{"input_ids": input_ids[a:b].to(stream.device)} for a, b in parts], kept,
                               keep_inputs=True)
        for part, (start, end) in enumerate(parts):  # the head: the loss's gradient at the last layer's output
            leaf = kept.get((last, part)).to(stream.device).requires_grad_(True)
            (head_loss(model, leaf, input_ids[start:end].to(stream.device)) * (end - start)).backward()
            kept.put(("grad", part), leaf.grad)  # Σ over samples of each sample's mean token loss
            kept.drop((last, part))
        for index in reversed(range(last)):
            layer = stream.layer(index)
            params = layer_parameters(layer, sliced_norms(model))
            buffers = {p: torch.zeros_like(p, dtype=torch.float32) for _, p in params}
            for _, p in params:
                p.requires_grad_(True)
            for part, (start, end) in enumerate(parts):
                x = kept.get((index, part)).to(stream.device).requires_grad_(index > 0)
                hidden_of(layer(x, **calls[part][index])).backward(kept.get(("grad", part)).to(stream.device))
                for _, p in params:
                    buffers[p].add_(p.grad)
                    p.grad = None
                if index > 0:
                    kept.put(("grad", part), x.grad)
                else:
                    kept.drop(("grad", part))
                kept.drop((index, part))  # this layer's part is done with
                if end in taken:
                    taken[end].append(layer_snapshot(layer, params, buffers, end))
            for _, p in params:
                p.requires_grad_(False)
            del buffers
            stream.release(index)
        return {n: assembled(list(reversed(per_layer)), layout, n) for n, per_layer in taken.items()}
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
            p.grad = None
        model.train(was_training)
