"""The calibration loss of a model as a plan would prune it, without pruning it: the plan's groups are masked in
place (their output columns zeroed) for one forward pass, then restored.

Zeroing the o_proj columns of a removed group's query heads and the down_proj columns of a removed MLP channel gives
exactly the pruned model's function: attention is per head, so the other heads do not see the masked ones, and the
masked outputs add nothing (the biases of o_proj and down_proj stay, as they do in the pruned model). A family whose
q_norm / k_norm span the whole projections (OLMo-2) normalises, once pruned, over the rows it kept: masked, those
norms compute over the kept rows as well (`_KeptRows`), so that the masked model is the pruned one there too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import contextmanager

import torch

from taylor_tune.pruning.groups import decoder_layers, head_dim, kept, q_per_kv, rows_of, sliced_norms
from taylor_tune.pruning.plan import PrunePlan
from taylor_tune.sources.streaming import batch_logits, is_stream

LOSS_SEQUENCES = 32  # calibration sequences per candidate: one forward each, at most G candidates per pruning


class _Skipped(torch.nn.Module):
    """A decoder layer removed whole: gives back its input."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class _KeptRows(torch.nn.Module):
    """A whole-projection norm as the pruned model has it: over the entries `keep` only, with their weights; the
    others give 0 (their heads' outputs are masked at o_proj)."""

    def __init__(self, norm: torch.nn.Module, keep: torch.Tensor):
        super().__init__()
        self.keep = keep
        self.kept = copy.deepcopy(norm)
        self.kept.weight = torch.nn.Parameter(norm.weight.detach()[keep], requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(x.shape)
        out[..., self.keep] = self.kept(x[..., self.keep])
        return out


def _mask_layer(layer: torch.nn.Module, attn_removed, mlp_removed, norm_rows: bool) -> tuple[list, list]:
    """One decoder layer made to compute what its pruned self computes, in place: the removed groups' o_proj and
    down_proj columns zeroed, a whole-projection norm over the kept rows. Returns what restores it: (linear, columns,
    their values) and (attention, norm name, the norm)."""
    saved, norms = [], []
    attn = layer.self_attn
    width = q_per_kv(attn) * head_dim(attn)
    with torch.no_grad():
        if attn_removed and norm_rows:
            for name, proj, rows in (("q_norm", attn.q_proj, width), ("k_norm", attn.k_proj, head_dim(attn))):
                norm = getattr(attn, name)
                norms.append((attn, name, norm))
                keep = rows_of(kept(proj.out_features // rows, attn_removed), rows).to(norm.weight.device)
                setattr(attn, name, _KeptRows(norm, keep))
        columns = ((layer.mlp.down_proj, list(mlp_removed)),
                   (attn.o_proj, [g * width + i for g in attn_removed for i in range(width)]))
        for linear, index in columns:
            if index:
                index = torch.tensor(index, device=linear.weight.device)
                saved.append((linear, index, linear.weight[:, index].clone()))
                linear.weight[:, index] = 0
    return saved, norms


@contextmanager
def masked(model: torch.nn.Module, plan: PrunePlan):
    """Inside, `model` computes what the plan's pruned model computes (its whole layers removed skipped); its weights
    and layers are restored on exit."""
    saved, norms, layers, norm_rows = [], [], decoder_layers(model), sliced_norms(model)
    for layer, attn_removed, mlp_removed in zip(layers, plan.attn_removed, plan.mlp_removed):
        weights, replaced = _mask_layer(layer, attn_removed, mlp_removed, norm_rows)
        saved += weights
        norms += replaced
    skipped = {i: layers[i] for i in plan.layers_removed}
    for i in skipped:
        layers[i] = _Skipped()
    try:
        yield model
    finally:
        with torch.no_grad():
            for linear, index, values in saved:
                linear.weight[:, index] = values
        for i, layer in skipped.items():
            layers[i] = layer
        for attn, name, norm in norms:
            setattr(attn, name, norm)


class _MaskedStream:
    """A model held layer by layer (`sources.streaming.Checkpoint`) as a plan would prune it: each layer masked as it
    is read (a fresh copy from the checkpoint, so nothing to restore), a removed layer skipped."""

    def __init__(self, stream, plan: PrunePlan):
        self.stream, self.plan = stream, plan
        self.model, self.device, self.num_layers = stream.model, stream.device, stream.num_layers
        self.scratch = stream.scratch

    def layer(self, index: int) -> torch.nn.Module:
        if index in self.plan.layers_removed:
            return _Skipped()
        layer = self.stream.layer(index)
        _mask_layer(layer, self.plan.attn_removed[index], self.plan.mlp_removed[index], sliced_norms(self.model))
        return layer

    def release(self, index: int) -> None:
        if index not in self.plan.layers_removed:
            self.stream.release(index)


@torch.no_grad()
def calibration_loss(model, ids: torch.Tensor, micro_batch_size: int) -> float:
    """Mean next-token cross-entropy over the sequences `ids` (every predicted token weighs the same); `model` a
    loaded one, or one held layer by layer (`sources.streaming`), taken layer-major over the micro-batches."""
    batches = ids.split(micro_batch_size)
    total, tokens = 0.0, 0
    for batch, out in zip(batches, batch_logits(model, batches), strict=True):
        batch, out = batch.to(out.device), out[:, :-1].float()
        total += float(torch.nn.functional.cross_entropy(out.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum"))
        tokens += batch[:, 1:].numel()
    return total / tokens


def plan_loss(model, ids: Callable[[], torch.Tensor], micro_batch_size: int):
    """`PlanOptions.plan_loss` for this model: a candidate plan's calibration loss on the first LOSS_SEQUENCES of
    `ids()`, called only when a planner measures (the calibration draw is not made otherwise). A model held layer
    by layer is read once per candidate, each layer masked as it comes in."""

    def loss(plan: PrunePlan) -> float:
        if is_stream(model):
            return calibration_loss(_MaskedStream(model, plan), ids()[:LOSS_SEQUENCES], micro_batch_size)
        with masked(model, plan):
            return calibration_loss(model, ids()[:LOSS_SEQUENCES], micro_batch_size)

    return loss
