"""The activation baselines' statistics and scores: Wanda-sp and FLAP (CASIA-IVA-Lab/FLAP), forward only.

One forward pass over the calibration rows, hooks on each layer's two output projections (o_proj, down_proj) reading
their inputs: per input feature the token count, mean and sum of squared deviations, accumulated per micro-batch in
float32 (or the model's wider dtype) on the device and merged in float64 (Chan et al.'s pairwise update), so no
activation is kept.

Scores per group, for a layer's o_proj (attention groups: the q_per_kv x head_dim columns of a key/value group) and
down_proj (MLP channel c: column c), from the weight W [out, in] and the column's input statistics:
- wanda_sp: per column j, mean_i |W_ij| x ||X_j|| (the L2 norm over the calibration tokens), as FLAP's repository
  scores its Wanda-sp baseline; a group's score is the mean over its columns (the repository sums a head's columns
  and ranks heads and channels apart; the mean puts heads and channels on one per-column scale, so one ranking can
  hold both, and orders a layer's heads as the sum does).
- flap: per column j, the fluctuation Var(X_j) x sum_i W_ij^2 (FLAP's WIFV; squared again for attention, as FLAP
  does), standardized over the layer's columns of that projection ((v - mean) / std, std with n - 1 as torch.std),
  a group's score the mean over its columns. Standardized, attention and MLP compete in one ranking (FLAP's
  adaptive structure is the global ranking of that score); the scores carry no size of a layer, so methods that
  allocate by layer sums (layerwise, blockwise) do not take them.
The means are what FLAP's bias compensation adds back (pruning/compensation.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from taylor_tune.pruning.groups import decoder_layers
from taylor_tune.pruning.importance import sample_counts
from taylor_tune.pruning.plan import GroupScores, ModelLayout
from taylor_tune.pruning.streamed import spans
from taylor_tune.sources.streaming import Kept, Resident, forward_layers, is_stream

ACTIVATION_CRITERIA = ("wanda_sp", "flap")


@dataclass(frozen=True)
class FeatureStats:
    """Per input feature of one projection over the calibration tokens."""

    tokens: int
    mean: np.ndarray
    m2: np.ndarray  # sum of squared deviations from the mean

    @property
    def sq_norm(self) -> np.ndarray:
        """sum_t x_tj^2 = m2 + tokens x mean^2."""
        return self.m2 + self.tokens * self.mean**2

    @property
    def variance(self) -> np.ndarray:
        """Population variance (m2 / tokens); FLAP's n - 1 scales every column alike and standardization removes it."""
        return self.m2 / self.tokens


@dataclass(frozen=True)
class ActivationStats:
    """Per layer, the statistics of o_proj's and down_proj's inputs."""

    attn: tuple[FeatureStats, ...]
    mlp: tuple[FeatureStats, ...]


class _Accumulator:
    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, None, None

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.promote_types(x.dtype, torch.float32))  # float32 at least
        n = x.shape[0]
        mean = x.mean(dim=0)
        m2 = (x - mean).square().sum(dim=0)
        mean, m2 = mean.double().cpu(), m2.double().cpu()
        if self.n == 0:
            self.n, self.mean, self.m2 = n, mean, m2
            return
        total = self.n + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta.square() * (self.n * n / total)
        self.n = total

    def stats(self) -> FeatureStats:
        return FeatureStats(self.n, self.mean.numpy().copy(), self.m2.numpy().copy())


@torch.no_grad()
def activation_stats(model, ids: torch.Tensor, micro_batch_size: int = 8,
                     snapshots: list[int] | None = None) -> dict[int, ActivationStats]:
    """The statistics at each row count in `snapshots` (default: all rows of `ids`, [rows, seq_len]), one forward
    pass: the first n rows are the n-sample draw (nested draws), as for the gradient pass. The model's mode is
    restored. A model held layer by layer (`sources.streaming`) is taken layer-major: the same micro-batches through
    each layer in turn, so the same statistics."""
    total = ids.shape[0]
    counts = sample_counts(total, snapshots)
    if is_stream(model):
        return _streamed_stats(model, ids, counts, micro_batch_size)
    layers = decoder_layers(model)
    device = next(model.parameters()).device
    accumulators = [(_Accumulator(), _Accumulator()) for _ in layers]
    handles = []
    for layer, (attn, mlp) in zip(layers, accumulators):
        handles += _hooked(layer, attn, mlp)
    was_training = model.training
    model.eval()
    results, done = {}, 0
    try:
        for boundary in counts:
            while done < boundary:
                batch = ids[done : min(done + micro_batch_size, boundary)]
                model(input_ids=batch.to(device), use_cache=False)
                done += batch.shape[0]
            results[boundary] = ActivationStats(attn=tuple(a.stats() for a, _ in accumulators),
                                                mlp=tuple(m.stats() for _, m in accumulators))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return results


def _hooked(layer: nn.Module, attn: _Accumulator, mlp: _Accumulator) -> list:
    """Hooks adding the inputs of the layer's o_proj and down_proj to their accumulators."""
    return [layer.self_attn.o_proj.register_forward_pre_hook(lambda m, args: attn.add(args[0])),
            layer.mlp.down_proj.register_forward_pre_hook(lambda m, args: mlp.add(args[0]))]


def _streamed_stats(stream, ids: torch.Tensor, counts: list[int], micro_batch_size: int) -> dict[int, ActivationStats]:
    parts = spans(ids.shape[0], counts, micro_batch_size)
    taken: dict[int, list[tuple[FeatureStats, FeatureStats]]] = {n: [] for n in counts}

    @contextlib.contextmanager
    def watch(index, layer):
        attn, mlp = _Accumulator(), _Accumulator()
        handles = _hooked(layer, attn, mlp)

        def seen(part, x, y):
            if parts[part][1] in taken:
                taken[parts[part][1]].append((attn.stats(), mlp.stats()))

        try:
            yield seen
        finally:
            for handle in handles:
                handle.remove()

    forward_layers(stream, [{"input_ids": ids[a:b].to(stream.device)} for a, b in parts], Kept(), watch=watch)
    return {n: ActivationStats(attn=tuple(a for a, _ in per_layer), mlp=tuple(m for _, m in per_layer))
            for n, per_layer in taken.items()}


def check_stats(stats: ActivationStats, layout: ModelLayout) -> None:
    """Statistics as they must be to score this model's groups (checked before stored ones are used): one entry per
    layer, an MLP channel's per down_proj input, finite means, non-negative finite deviations, tokens counted.
    ValueError naming what is not."""
    if len(stats.attn) != layout.num_layers or len(stats.mlp) != layout.num_layers:
        raise ValueError(f"activation statistics for {len(stats.attn)}/{len(stats.mlp)} layers, the model has "
                         f"{layout.num_layers}")
    for layer, (attn, mlp) in enumerate(zip(stats.attn, stats.mlp)):
        if len(mlp.mean) != layout.mlp_channels[layer] or len(attn.mean) % layout.attn_groups[layer]:
            raise ValueError(f"activation statistics of layer {layer} do not match its projections' inputs")
        for part in (attn, mlp):
            if part.tokens <= 0 or len(part.m2) != len(part.mean) or not np.isfinite(part.mean).all() \
                    or not np.isfinite(part.m2).all() or (part.m2 < 0).any():
                raise ValueError(f"activation statistics of layer {layer}: a count, mean or deviation is not a "
                                 "finite number of its kind")


def _columns(weight: torch.Tensor, power: int) -> np.ndarray:
    w = weight.detach().double().cpu()
    return (w.abs().mean(dim=0) if power == 1 else w.square().sum(dim=0)).numpy()


def _standardized(values: np.ndarray) -> np.ndarray:
    return (values - values.mean()) / values.std(ddof=1)


def _group_mean(columns: np.ndarray, groups: int) -> np.ndarray:
    return columns.reshape(groups, -1).mean(axis=1)


def activation_scores(model, layout: ModelLayout, stats: ActivationStats, criterion: str) -> GroupScores:
    """The `criterion` (wanda_sp or flap) scores of every group, as the module docstring defines them; `model` a
    loaded one or one held layer by layer (`sources.streaming`: each layer's two output projections read alone)."""
    if criterion not in ACTIVATION_CRITERIA:
        raise ValueError(f"unknown activation criterion {criterion!r}; allowed: {', '.join(ACTIVATION_CRITERIA)}")
    stream = model if is_stream(model) else Resident(model)
    attn_scores, mlp_scores = [], []
    for layer, (attn_stats, mlp_stats) in enumerate(zip(stats.attn, stats.mlp)):
        o_proj = stream.tensor(f"model.layers.{layer}.self_attn.o_proj.weight")
        down_proj = stream.tensor(f"model.layers.{layer}.mlp.down_proj.weight")
        if criterion == "wanda_sp":
            attn = _columns(o_proj, 1) * np.sqrt(attn_stats.sq_norm)
            mlp = _columns(down_proj, 1) * np.sqrt(mlp_stats.sq_norm)
        else:
            attn = _standardized((attn_stats.variance * _columns(o_proj, 2)) ** 2)
            mlp = _standardized(mlp_stats.variance * _columns(down_proj, 2))
        attn_scores.append(_group_mean(attn, layout.attn_groups[layer]))
        mlp_scores.append(mlp)
    scores = GroupScores(attn=tuple(attn_scores), mlp=tuple(mlp_scores))
    scores.check_matches(layout)
    return scores
