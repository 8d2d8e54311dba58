"""The importance service: what a pruning's planner ranks, had through one call (`score_groups`).

Behind that call: the calibration draw (`Calibration`, made once and only when something asks for it), the
gradient pass, and the optional shared cache of gradient passes (a sweep's; a hit draws no calibration). Methods
that rank by weight magnitude or draw their own scores get them here too, so a caller never asks which kind of
method it runs. Must not load a model or write anything but the cache's entries.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from taylor_tune.config import PruneConfig
from taylor_tune.pruning.activations import (
    ACTIVATION_CRITERIA,
    ActivationStats,
    activation_scores,
    activation_stats,
    check_stats,
)
from taylor_tune.pruning.depth import LayerSimilarity
from taylor_tune.pruning.experts import ExpertScores, expert_scores
from taylor_tune.pruning.importance import (
    GRADIENT_CRITERIA,
    Importance,
    check_importance,
    compute_importance,
    magnitude_scores,
    taylor_criterion,
)
from taylor_tune.pruning.importance_cache import ImportanceCache, stats_from_tensors, stats_to_tensors
from taylor_tune.pruning.methods import METHODS, Scoring
from taylor_tune.pruning.plan import GroupScores, ModelLayout
from taylor_tune.pruning.similarity import layer_similarity
from taylor_tune.pruning.streamed import compute_importance_streamed
from taylor_tune.sources.calibration import load_calibration
from taylor_tune.sources.data import resolve_text
from taylor_tune.sources.streaming import is_stream


def uses_gradients(config: PruneConfig) -> bool:
    if METHODS[config.method].scored_by is Scoring.LAYERS:  # depth: its taylor criterion, from the same pass
        return config.depth_criterion == "taylor"
    if METHODS[config.method].scored_by is Scoring.EXPERTS:  # a gradient pass of its own (pruning/experts.py)
        return config.expert_criterion == "taylor"
    return METHODS[config.method].scored_by is Scoring.CRITERION and config.criterion in GRADIENT_CRITERIA


def uses_activations(config: PruneConfig) -> bool:
    """Scores from the output projections' inputs (wanda_sp, flap): one forward pass over the calibration rows."""
    return METHODS[config.method].scored_by is Scoring.CRITERION and config.criterion in ACTIVATION_CRITERIA


def draws_calibration(config: PruneConfig) -> bool:
    """Whether a pruning reads calibration text: gradient or activation scores, or a plan chosen by measured loss."""
    measured = config.uniform or (config.method == "blockwise" and config.blockwise_attention == "measured_loss") \
        or (cuts_layers(config) and config.depth_criterion == "measured_loss")
    return uses_gradients(config) or measured or uses_hidden_states(config) or uses_activations(config) \
        or METHODS[config.method].scored_by is Scoring.EXPERTS


def cuts_layers(config: PruneConfig) -> bool:
    """Whole layers go: depth, or a mixed cut (a width method with a depth_share)."""
    return METHODS[config.method].scored_by is Scoring.LAYERS or config.depth_share > 0


def uses_hidden_states(config: PruneConfig) -> bool:
    """Layers chosen by block influence or angular distance: one forward pass over the calibration rows."""
    return cuts_layers(config) and config.depth_criterion in ("block_influence", "angular")


def draw_calibration(config: PruneConfig, tokenizer, num_samples: int | None = None) -> torch.Tensor:
    """The calibration sequences `config` names ([num_samples, seq_len]; default config.num_samples). Draws are
    nested: the first n rows of a larger draw are the draw of n."""
    return load_calibration(tokenizer, resolve_text(config.calibration, config.model), seq_len=config.seq_len,
                            num_samples=num_samples or config.num_samples, seed=config.seed)


@dataclass
class Calibration:
    """One pruning's calibration draw, made when first asked for, again only if a later ask wants more rows."""

    config: PruneConfig
    tokenizer: object
    drawn: torch.Tensor | None = None
    seconds: float = 0.0  # spent drawing, in total

    def ids(self, num_samples: int | None = None) -> torch.Tensor:
        wanted = num_samples or self.config.num_samples
        if self.drawn is None or self.drawn.shape[0] < wanted:
            start = time.perf_counter()
            self.drawn = draw_calibration(self.config, self.tokenizer, wanted)
            self.seconds += time.perf_counter() - start
        return self.drawn[:wanted]

    def used(self) -> torch.Tensor | None:
        """The config's own rows, if a draw was made (None: nothing asked for calibration)."""
        return None if self.drawn is None else self.drawn[: self.config.num_samples]


@dataclass(frozen=True)
class Scored:
    """What the planner ranks (None: the method draws its own), the gradient importance behind it (None without a
    gradient pass), what the shared cache did (None without one) and the seconds spent, calibration apart."""

    scores: GroupScores | LayerSimilarity | ExpertScores | None  # LayerSimilarity: depth's; ExpertScores: experts'
    importance: Importance | None = None
    similarity: LayerSimilarity | None = None  # a mixed cut's layers (block_influence, angular)
    activations: ActivationStats | None = None  # wanda_sp's and flap's (flap's compensation reads their means)
    cache_event: str | None = None
    timings: dict[str, float] = field(default_factory=dict)


def importance_fields(config: PruneConfig, *, dtype: torch.dtype, device: torch.device) -> dict:
    """What a gradient pass depends on: the cache key's fields, with the dtype and device type the model was loaded
    in (not the config's `auto`: an entry of a float32 CPU pass must not serve a bfloat16 GPU trial)."""
    return {
        "model": config.model,
        "calibration": resolve_text(config.calibration, config.model),
        "seq_len": config.seq_len,
        "seed": config.seed,
        "dtype": str(dtype).removeprefix("torch."),
        "device": torch.device(device).type,
        "micro_batch_size": config.micro_batch_size,
    }


def gradient_importance(model, layout: ModelLayout, calibration: Calibration, *,
                        cache: ImportanceCache | None = None, sample_counts=()) -> Importance:
    """The importance at the config's num_samples: from the cache (one pass at the largest of `sample_counts`
    serves them all), or computed here."""
    config = calibration.config
    counts = sorted(set(sample_counts) | {config.num_samples})

    streamed = is_stream(model)
    # a model held layer by layer takes the pass layer-major (pruning.streamed): the same importance to rounding
    compute_pass = compute_importance_streamed if streamed else compute_importance

    def compute() -> dict[int, Importance]:
        ids = calibration.ids(counts[-1])
        return compute_pass(model, layout, ids, micro_batch_size=config.micro_batch_size, snapshots=counts)

    if cache is None:
        return compute()[config.num_samples]
    parameter = next((model.model if streamed else model).parameters())
    # a streamed pass is keyed apart: it equals the in-memory pass to rounding, not bit for bit
    fields = importance_fields(config, dtype=parameter.dtype, device=parameter.device) | (
        {"streamed": True} if streamed else {})
    return cache.get_or_compute(fields, counts, compute, check=lambda imp: check_importance(imp, layout))[
        config.num_samples]


def activation_statistics(model, layout: ModelLayout, calibration: Calibration, *,
                          cache: ImportanceCache | None = None, sample_counts=()) -> ActivationStats:
    """wanda_sp's and flap's statistics at the config's num_samples: from the cache (keyed as the gradient pass is,
    under a key of their own; one pass at the largest of `sample_counts` serves them all), or computed here."""
    config = calibration.config
    counts = sorted(set(sample_counts) | {config.num_samples})

    def compute() -> dict[int, ActivationStats]:
        return activation_stats(model, calibration.ids(counts[-1]), config.micro_batch_size, snapshots=counts)

    if cache is None:
        return compute()[config.num_samples]
    parameter = next(model.parameters())
    fields = importance_fields(config, dtype=parameter.dtype, device=parameter.device) | {"statistics": "activations"}
    return cache.get_or_compute(fields, counts, compute, check=lambda stats: check_stats(stats, layout),
                                encode=stats_to_tensors, decode=stats_from_tensors)[config.num_samples]


def score_groups(model, layout: ModelLayout, calibration: Calibration, *, cache: ImportanceCache | None = None,
                 sample_counts=()) -> Scored:
    """The scores the config's method ranks, with their seconds: importance_s, similarity_s for a mixed cut's layer
    measure, and calibration_s when this call drew calibration."""
    config = calibration.config
    start, drawn_before = time.perf_counter(), calibration.seconds
    importance, event, activations = None, None, None
    if METHODS[config.method].scored_by is Scoring.EXPERTS:  # each trial's own pass, never cached
        scores = expert_scores(model, calibration.ids(), config.expert_criterion, config.micro_batch_size)
    elif uses_activations(config):
        activations = activation_statistics(model, layout, calibration, cache=cache, sample_counts=sample_counts)
        scores = activation_scores(model, layout, activations, config.criterion)
        event = None if cache is None else cache.last_event
    elif uses_gradients(config):
        importance = gradient_importance(model, layout, calibration, cache=cache, sample_counts=sample_counts)
        # depth's taylor is the group-normalized criterion whatever `criterion` says (a whole layer's mean)
        criterion = "taylor" if METHODS[config.method].scored_by is Scoring.LAYERS else config.criterion
        scores = taylor_criterion(importance.scores, layout, criterion)
        event = None if cache is None else cache.last_event
    elif METHODS[config.method].scored_by is Scoring.LAYERS and uses_hidden_states(config):
        scores = layer_similarity(model, calibration.ids(), config.micro_batch_size)
    elif METHODS[config.method].scored_by is Scoring.LAYERS:  # depth's measured_loss and last: nothing to score
        scores = None
    elif METHODS[config.method].scored_by is not Scoring.NONE:  # a weight-magnitude criterion, or magnitude
        scores = magnitude_scores(model, layout, p=1 if config.criterion == "l1" else 2)
    else:
        scores = None
    similarity, similarity_s = None, 0.0
    if config.depth_share > 0 and uses_hidden_states(config):  # a mixed cut: its layers' measure besides
        # each mixed trial's own pass (never cached): timed apart from the scores a cache serves, without the draw
        began, drawn = time.perf_counter(), calibration.seconds
        similarity = layer_similarity(model, calibration.ids(), config.micro_batch_size)
        similarity_s = time.perf_counter() - began - (calibration.seconds - drawn)
    drew = calibration.seconds - drawn_before
    timings = {"importance_s": time.perf_counter() - start - drew - similarity_s} \
        | ({"similarity_s": similarity_s} if similarity is not None else {}) | ({"calibration_s": drew} if drew else {})
    return Scored(scores, importance, cache_event=event, timings=timings, similarity=similarity,
                  activations=activations)
