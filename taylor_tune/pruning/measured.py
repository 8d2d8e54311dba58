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


@contextmanager
def masked(model: torch.nn.Module, plan: PrunePlan):
    """Inside, `model` computes what the plan's pruned model computes (its whole layers removed skipped); its weights
    and layers are restored on exit."""
    saved, norms, layers, norm_rows = [], [], decoder_layers(model), sliced_norms(model)
    with torch.no_grad():
        for layer, attn_removed, mlp_removed in zip(layers, plan.attn_removed, plan.mlp_removed):
            attn = layer.self_attn
            width = q_per_kv(attn) * head_dim(attn)
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


@torch.no_grad()
def calibration_loss(model: torch.nn.Module, ids: torch.Tensor, micro_batch_size: int) -> float:
    """Mean next-token cross-entropy over the sequences `ids` (every predicted token weighs the same)."""
    device = next(model.parameters()).device
    total, tokens = 0.0, 0
    for batch in ids.split(micro_batch_size):
        batch = batch.to(device)
        logits = model(input_ids=batch).logits[:, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum"))
        tokens += batch[:, 1:].numel()
    return total / tokens


def plan_loss(model: torch.nn.Module, ids: Callable[[], torch.Tensor], micro_batch_size: int):
    """`PlanOptions.plan_loss` for this model: a candidate plan's calibration loss on the first LOSS_SEQUENCES of
    `ids()`, called only when a planner measures (the calibration draw is not made otherwise)."""

    def loss(plan: PrunePlan) -> float:
        with masked(model, plan):
            return calibration_loss(model, ids()[:LOSS_SEQUENCES], micro_batch_size)

    return loss
