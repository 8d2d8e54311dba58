"""The gradient pass taken layer-major (issue 92, first step): the same Taylor importance as
`importance.compute_importance`, to float rounding, while the device holds one layer's gradient buffers.

ḡ is a sum over the calibration sequences, so it can be taken one decoder layer at a time. A forward pass without
gradients keeps each layer's input for every micro-batch (and what the layer was called with: positions, masks),
and the last layer's output. The head (final norm, lm_head, the loss as the model computes it) gives the gradient of
Σ over samples of each sample's mean token loss with respect to that output. Then, from the last layer to the first,
each micro-batch's kept input goes through the layer again with gradients on, the output's gradient flows back
through it alone, the layer's prunable parameters accumulate ḡ in fp32 buffers the size of that layer, and the
input's gradient becomes the output gradient of the layer below. At each sample count in `snapshots` the layer's
group sums and gradient statistics are taken, as the in-memory pass takes them for every layer at once.

What lives where: the kept activations and gradients (two per micro-batch: a layer's inputs, and the gradient
flowing down) on the host; one layer's buffers beside the model. The weights here are the loaded model's; reading
each layer's weights from the checkpoint one at a time comes next (the module's contract does not change).
"""

from __future__ import annotations

import torch
from torch import nn

from taylor_tune.pruning.groups import decoder_layers, prunable_parameters
from taylor_tune.pruning.importance import Importance, assembled, layer_snapshot, sample_counts
from taylor_tune.pruning.plan import ModelLayout


def spans(total: int, counts: list[int], micro_batch_size: int) -> list[tuple[int, int]]:
    """The micro-batches (start, end) of the in-memory pass: `micro_batch_size` rows, never across a snapshot."""
    out, done = [], 0
    for boundary in counts:
        while done < boundary:
            out.append((done, min(done + micro_batch_size, boundary)))
            done = out[-1][1]
    return out


def head_loss(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The model's causal-LM loss from its last decoder layer's output, as its own forward computes it: the final
    norm, lm_head, the logit scaling and soft-cap its config names (Granite's `logits_scaling`, Gemma's
    `final_logit_softcapping`), then its loss function."""
    logits = model.lm_head(model.model.norm(hidden))
    config = model.config
    if getattr(config, "logits_scaling", None):
        logits = logits / config.logits_scaling
    if getattr(config, "final_logit_softcapping", None):
        logits = torch.tanh(logits / config.final_logit_softcapping) * config.final_logit_softcapping
    return model.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size)


def _kept_forward(model: nn.Module, input_ids: torch.Tensor, parts: list[tuple[int, int]], device):
    """Per layer and micro-batch, its input (on the host) and the keywords it was called with; and per micro-batch
    the last layer's output (on the host). No gradients."""
    layers = decoder_layers(model)
    inputs = [[None] * len(parts) for _ in layers]
    calls = [[None] * len(parts) for _ in layers]
    final, at = [None] * len(parts), {"part": 0}

    def keep(index):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            inputs[index][at["part"]] = hidden.detach().to("cpu")
            calls[index][at["part"]] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        return hook

    def keep_output(module, args, output):
        final[at["part"]] = (output[0] if isinstance(output, tuple) else output).detach().to("cpu")

    hooks = [layer.register_forward_pre_hook(keep(i), with_kwargs=True) for i, layer in enumerate(layers)]
    hooks.append(layers[-1].register_forward_hook(keep_output))
    try:
        with torch.no_grad():
            for part, (start, end) in enumerate(parts):
                at["part"] = part
                model.model(input_ids=input_ids[start:end].to(device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return inputs, calls, final


def compute_importance_streamed(model: nn.Module, layout: ModelLayout, input_ids: torch.Tensor, *,
                                micro_batch_size: int = 8, snapshots: list[int] | None = None) -> dict[int, Importance]:
    """`importance.compute_importance`, layer-major (the module's docstring): the same arguments and results. The
    model's requires_grad flags and mode are restored afterwards."""
    total = input_ids.shape[0]
    counts = sample_counts(total, snapshots)
    device = next(model.parameters()).device
    parts = spans(total, counts, micro_batch_size)
    layers, prunable = decoder_layers(model), prunable_parameters(model)
    flags = {p: p.requires_grad for p in model.parameters()}
    was_training = model.training
    taken: dict[int, list] = {n: [] for n in counts}
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        model.eval()  # dropout off, as the in-memory pass
        inputs, calls, final = _kept_forward(model, input_ids, parts, device)
        grads = []
        for (start, end), hidden in zip(parts, final):
            leaf = hidden.to(device).requires_grad_(True)
            labels = input_ids[start:end].to(device)
            (head_loss(model, leaf, labels) * (end - start)).backward()  # Σ over samples of each sample's mean
            grads.append(leaf.grad.to("cpu"))
        del final
        for index in reversed(range(len(layers))):
            layer, params = layers[index], prunable[index]
            buffers = {p: torch.zeros_like(p, dtype=torch.float32) for _, p in params}
            for _, p in params:
                p.requires_grad_(True)
            for part, (start, end) in enumerate(parts):
                x = inputs[index][part].to(device).requires_grad_(index > 0)
                out = layer(x, **calls[index][part])
                (out[0] if isinstance(out, tuple) else out).backward(grads[part].to(device))
                for _, p in params:
                    buffers[p].add_(p.grad)
                    p.grad = None
                if index > 0:
                    grads[part] = x.grad.to("cpu")
                inputs[index][part] = calls[index][part] = None  # this layer's part is done with
                if end in taken:
                    taken[end].append(layer_snapshot(layer, params, buffers, end))
            for _, p in params:
                p.requires_grad_(False)
            del buffers
        return {n: assembled(list(reversed(per_layer)), layout, n) for n, per_layer in taken.items()}
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
            p.grad = None
        model.train(was_training)
