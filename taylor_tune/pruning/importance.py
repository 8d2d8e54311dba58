"""Group importance: one gradient pass over the calibration data, scores at several sample counts.

ḡ is the gradient of the mean causal-LM loss over all n calibration sequences (all of one length, so the
token mean equals the mean of per-sequence means). Micro-batches accumulate Σ_samples ∂loss_s/∂θ into fp32
buffers through post-accumulate-grad hooks that free each `.grad` at once, so no full set of gradients is
ever alive beside the buffers. Embeddings, lm_head and norms get no gradient at all.

One pass over N sequences yields the scores for every n in `snapshots` (nested draws: the first n
sequences of N are the n-sample draw), e.g. 128/256/512 from a 512-sequence pass.

Group score (docs/specification.md §1) = Σ_{params in group} |w · ḡ| / (params in group).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from taylor_tune.progress import bar
from taylor_tune.pruning.groups import (
    decoder_layers,
    layer_parameters,
    prunable_parameters,
    reduce_layer,
    reduce_to_groups,
    sliced_norms,
)
from taylor_tune.pruning.plan import GroupScores, ModelLayout
from taylor_tune.sources.streaming import is_stream


@dataclass(frozen=True)
class Importance:
    """Scores and per-layer gradient statistics at one sample count."""

    num_samples: int
    scores: GroupScores
    grad_mean: np.ndarray  # per layer: mean |ḡ| over its prunable parameters
    grad_norm: np.ndarray  # per layer: L2 norm of ḡ over its prunable parameters


def check_importance(importance: Importance, layout: ModelLayout) -> None:
    """Gradient importance as it must be to rank this model's groups (checked before stored scores are used): one
    score per group of the layout, per-layer statistics for every layer, all finite and non-negative (each is a mean
    of absolute values or a norm). ValueError naming what is not."""
    importance.scores.check_matches(layout)
    layers = layout.num_layers
    parts = {"attention scores": importance.scores.attn, "MLP scores": importance.scores.mlp,
             "layer_grad_mean": (importance.grad_mean,), "layer_grad_norm": (importance.grad_norm,)}
    if len(importance.grad_mean) != layers or len(importance.grad_norm) != layers:
        raise ValueError(f"importance at {importance.num_samples} samples: gradient statistics for "
                         f"{len(importance.grad_mean)}/{len(importance.grad_norm)} layers, the model has {layers}")
    for what, arrays in parts.items():
        for array in arrays:
            array = np.asarray(array, dtype=np.float64)
            if not np.isfinite(array).all() or (array < 0).any():
                raise ValueError(f"importance at {importance.num_samples} samples: {what} hold a negative or "
                                 "non-finite value (they are means of absolute values)")


def _to_scores(attn: list[torch.Tensor], mlp: list[torch.Tensor], layout: ModelLayout) -> GroupScores:
    return GroupScores(
        attn=tuple((a / layout.attn_group_params).double().cpu().numpy() for a in attn),
        mlp=tuple((m / layout.mlp_channel_params).double().cpu().numpy() for m in mlp),
    )


def taylor_criterion(scores: GroupScores, layout: ModelLayout, criterion: str) -> GroupScores:
    """The scores a method ranks by: `taylor` as computed (Σ|w·ḡ| / group size), `taylor_sum` the plain group sum.

    Every attention group of an unpruned model has one size and every MLP channel another, so the two criteria
    rank groups of one kind identically; they differ only where attention groups and MLP channels are compared
    (the global ranking) and in layer-level sums (layerwise).
    """
    if criterion == "taylor":
        return scores
    if criterion == "taylor_sum":
        return GroupScores(attn=tuple(a * layout.attn_group_params for a in scores.attn),
                           mlp=tuple(m * layout.mlp_channel_params for m in scores.mlp))
    raise ValueError(f"unknown criterion {criterion!r}")


GRADIENT_CRITERIA = ("taylor", "taylor_sum")


def magnitude_scores(model: nn.Module, layout: ModelLayout, p: int = 2) -> GroupScores:
    """Σ|w|^p over each group's parameters divided by its parameter count: the mean squared weight (p = 2, criterion
    l2, the magnitude baseline) or the mean absolute weight (p = 1, l1). No data, no gradients.

    Within one block every attention group has one size and every MLP channel another, so the division changes no
    ranking inside a block: LLM-Pruner's vector-wise L1/L2 importance (the group's Σ|w|^p, averaged over the
    group's layers) orders each block's groups the same way. A model held layer by layer (`sources.streaming`) is
    read one layer at a time."""
    def value(name: str, w: torch.Tensor) -> torch.Tensor:
        return w.float().abs().pow(p)

    with torch.no_grad():
        if not is_stream(model):
            attn, mlp = reduce_to_groups(model, value)
            return _to_scores(attn, mlp, layout)
        norms, attn, mlp = sliced_norms(model.model), [], []
        for index in range(model.num_layers):
            layer = model.layer(index)
            a, m = reduce_layer(layer, layer_parameters(layer, norms), value)
            attn.append(a)
            mlp.append(m)
            model.release(index)
    return _to_scores(attn, mlp, layout)


def layer_snapshot(layer, params, buffers, n: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """One layer's group sums of |w · ḡ| / n (attention, MLP) and its gradient statistics (mean |ḡ|, ‖ḡ‖) at n
    samples, from its prunable parameters' fp32 buffers of Σ over samples of the gradient."""
    with torch.no_grad():
        attn, mlp = reduce_layer(layer, params, lambda name, p: (p.float() * buffers[p]).abs_().div_(n))
        count = sum(p.numel() for _, p in params)
        mean = sum(float(buffers[p].abs().sum()) for _, p in params) / n / count
        norm = float(torch.stack([buffers[p].square().sum() for _, p in params]).sum().sqrt()) / n
    return attn, mlp, mean, norm


def assembled(per_layer: list, layout: ModelLayout, n: int) -> Importance:
    """The Importance at n samples from every layer's `layer_snapshot`, first layer first."""
    attn, mlp, means, norms = zip(*per_layer)
    return Importance(n, _to_scores(list(attn), list(mlp), layout), np.array(means), np.array(norms))


def sample_counts(total: int, snapshots: list[int] | None) -> list[int]:
    """The sample counts a pass over `total` sequences snapshots, sorted (default: all of them)."""
    counts = sorted(set(snapshots or [total]))
    if counts[0] <= 0 or counts[-1] > total:
        raise ValueError(f"snapshots {counts} must lie in [1, {total}]")
    return counts


def _snapshot(model, layout, buffers, n) -> Importance:
    return assembled([layer_snapshot(layer, params, buffers, n) for layer, params
                      in zip(decoder_layers(model), prunable_parameters(model))], layout, n)


def compute_importance(
    model: nn.Module,
    layout: ModelLayout,
    input_ids: torch.Tensor,
    *,
    micro_batch_size: int = 8,
    snapshots: list[int] | None = None,
) -> dict[int, Importance]:
    """Taylor importance at each sample count in `snapshots` (default: all rows of `input_ids`), one pass.

    `input_ids` is [N, seq_len] on any device; micro-batches are moved to the model's device.
    The model's parameters, requires_grad flags and mode are restored afterwards.
    """
    total = input_ids.shape[0]
    counts = sample_counts(total, snapshots)
    device = next(model.parameters()).device
    grouped = [p for params in prunable_parameters(model) for _, p in params]
    with gradient_sums(model, grouped) as buffers:
        results, done = {}, 0
        with bar(total * input_ids.shape[1], "importance", unit="tok", unit_scale=True) as progress:
            for boundary in counts:
                while done < boundary:
                    batch = input_ids[done : min(done + micro_batch_size, boundary)].to(device)
                    loss = model(input_ids=batch, labels=batch, use_cache=False).loss
                    (loss * batch.shape[0]).backward()  # Σ over samples of each sample's mean token loss
                    done += batch.shape[0]
                    progress.update(batch.numel())
                results[boundary] = _snapshot(model, layout, buffers, boundary)
        return results


@contextmanager
def gradient_sums(model: nn.Module, params: list[nn.Parameter]):
    """Within it, only `params` take gradients, each added at once into a float32 buffer (yielded: {parameter:
    buffer}) by a post-accumulate-grad hook that frees its `.grad`, and the model is in eval mode (dropout off: the
    gradient of the model as it will be used). The model's requires_grad flags and mode are restored afterwards."""
    buffers = {p: torch.zeros_like(p, dtype=torch.float32) for p in params}

    def accumulate(param: torch.Tensor) -> None:
        buffers[param].add_(param.grad)
        param.grad = None

    flags = {p: p.requires_grad for p in model.parameters()}
    was_training, hooks = model.training, []
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
            hooks.append(p.register_post_accumulate_grad_hook(accumulate))
        model.eval()
        yield buffers
    finally:
        for hook in hooks:
            hook.remove()
        for p, flag in flags.items():
            p.requires_grad_(flag)
            p.grad = None
        model.train(was_training)
