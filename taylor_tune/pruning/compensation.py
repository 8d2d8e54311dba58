"""FLAP's bias compensation: what the removed channels contributed on average, added back as a bias.

A removed input feature j of an output projection (o_proj: a removed attention group's columns; down_proj: a removed
MLP channel) contributed W[:, j] x_j to the output; compensation keeps its calibration mean, W[:, j] mean(x_j), in
the projection's bias. The pruned model then computes what the original computes with every removed feature held
at its mean (tests/pruning/test_activations.py checks exactly that). Output projections that had no bias get one.
"""

from __future__ import annotations

import torch
from torch import nn

from taylor_tune.pruning.activations import ActivationStats
from taylor_tune.pruning.groups import decoder_layers, head_dim, q_per_kv
from taylor_tune.pruning.plan import PrunePlan


def removed_columns(layer: nn.Module, attn_removed: tuple[int, ...]) -> list[int]:
    """o_proj's input columns of the removed attention groups."""
    width = q_per_kv(layer.self_attn) * head_dim(layer.self_attn)
    return [g * width + k for g in attn_removed for k in range(width)]


def _contribution(linear: nn.Linear, columns: list[int], mean) -> torch.Tensor | None:
    if not columns:
        return None
    w = linear.weight.detach().double()
    x = torch.as_tensor(mean, dtype=torch.float64, device=w.device)[columns]
    return w[:, columns] @ x


def compensations(model: nn.Module, plan: PrunePlan, stats: ActivationStats) -> list[tuple]:
    """Per layer of the unpruned model, the (o_proj, down_proj) bias each needs added (None: nothing removed), from
    the weights before the plan is applied."""
    out = []
    for layer, attn, mlp, a_stats, m_stats in zip(decoder_layers(model), plan.attn_removed, plan.mlp_removed,
                                                 stats.attn, stats.mlp):
        out.append((_contribution(layer.self_attn.o_proj, removed_columns(layer, attn), a_stats.mean),
                    _contribution(layer.mlp.down_proj, list(mlp), m_stats.mean)))
    return out


def _add_bias(linear: nn.Linear, delta: torch.Tensor) -> nn.Linear:
    new = nn.Linear(linear.in_features, linear.out_features, bias=True, device=linear.weight.device,
                    dtype=linear.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(linear.weight)
        base = linear.bias.detach().double() if linear.bias is not None else torch.zeros_like(delta)
        new.bias.copy_(base + delta)
    new.weight.requires_grad_(linear.weight.requires_grad)
    return new


def add_compensation(model: nn.Module, deltas: list[tuple], layers_removed: tuple[int, ...] = ()) -> nn.Module:
    """Add `compensations`' biases to the pruned model (in place); `layers_removed`: the original layers the plan
    removed whole (the rest are the pruned model's layers, in order)."""
    kept = [d for i, d in enumerate(deltas) if i not in set(layers_removed)]
    for layer, (attn, mlp) in zip(decoder_layers(model), kept, strict=True):
        if attn is not None:
            layer.self_attn.o_proj = _add_bias(layer.self_attn.o_proj, attn)
        if mlp is not None:
            layer.mlp.down_proj = _add_bias(layer.mlp.down_proj, mlp)
    return model
