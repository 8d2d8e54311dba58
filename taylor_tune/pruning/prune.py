"""One pruning, as its stages in order: load -> score -> plan -> apply. The sweep's trial runs the same stage
functions between its own (speed, evaluation); `prune` runs them alone, for the CLI and notebooks.

Every check that can fail on user input runs before the weights are loaded: the config (pydantic), the model's
config (architecture, context length), the tokenizer and, where the scores need it, the calibration draw. This
module is pruning's public face: the sweep imports pruning through the names in `__all__` only.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from taylor_tune.compat.transformers import building
from taylor_tune.config import PruneConfig
from taylor_tune.errors import ConfigError, PlanError
from taylor_tune.jsonio import write_json
from taylor_tune.pruning.activations import ActivationStats
from taylor_tune.pruning.aligned import aligned_plan
from taylor_tune.pruning.apply import apply_plan, layer_shapes, save_pruned_streamed
from taylor_tune.pruning.compensation import add_compensation, compensations
from taylor_tune.pruning.depth import LayerSimilarity
from taylor_tune.pruning.diagnostics import layer_analysis, pruning_diagnostics
from taylor_tune.pruning.groups import describe_layout
from taylor_tune.pruning.importance import Importance
from taylor_tune.pruning.importance_cache import ImportanceCache
from taylor_tune.pruning.measured import plan_loss
from taylor_tune.pruning.methods import METHODS, WIDTH_METHODS, PlanOptions, Scoring
from taylor_tune.pruning.methods.random import drawn_scores
from taylor_tune.pruning.mixed import kept_scores, mixed_plan, reindexed
from taylor_tune.pruning.plan import GroupScores, ModelLayout, PrunePlan
from taylor_tune.pruning.scoring import Calibration, draw_calibration, draws_calibration, score_groups, uses_gradients
from taylor_tune.pruning.uniform import uniform_plan
from taylor_tune.sources.data import check_calibration
from taylor_tune.sources.families import FAMILIES
from taylor_tune.sources.models import (
    held_split,
    load_model,
    load_model_config,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    stream_model,
    streamable,
)

__all__ = [
    "STAGES", "ImportanceCache", "Pruning", "PruneResult", "apply", "check_against_model", "check_plan",
    "draw_calibration", "draws_calibration", "layer_shapes", "load", "meta_layout", "meta_model", "plan", "prune",
    "score", "start", "summary_dict", "uses_gradients", "write_summary",
]

log = logging.getLogger(__name__)


@dataclass
class Pruning:
    """What the stages of one pruning build, in order; each stage fills its part and adds its seconds."""

    config: PruneConfig
    tokenizer: object
    calibration: Calibration
    cache: ImportanceCache | None = None  # a sweep's shared gradient passes
    sample_counts: tuple[int, ...] = ()  # every num_samples the cache's pass should serve
    model: torch.nn.Module | None = None  # pruned in place by `apply`
    layout: ModelLayout | None = None  # of the model before pruning
    importance: Importance | None = None  # None for methods that use no gradients
    scores: GroupScores | None = None
    similarity: LayerSimilarity | None = None  # a mixed cut's layer measure (block_influence, angular)
    activations: ActivationStats | None = None  # wanda_sp's and flap's statistics
    importance_cache: str | None = None  # what the shared cache did (hit, computed, ...); None without one
    plan: PrunePlan | None = None
    diagnostics: dict = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    streamed: bool = False  # the model held one decoder layer at a time (`sources.streaming`)
    pruned_folder: Path | None = None  # where a streamed pruning writes the pruned model, which is then read from it
    kept_folder: Path | None = None  # where a streamed pruning's passes keep their activations (None: the host)

    @property
    def calibration_ids(self) -> torch.Tensor | None:
        """The calibration rows this pruning used (None: a cache hit or a method without gradients drew none)."""
        return self.calibration.used()


PruneResult = Pruning  # the name callers knew


def check_against_model(config: PruneConfig) -> None:
    """Checks that need the calibration source to exist and the model's config (not its weights)."""
    check_calibration(config.calibration)
    model_config = load_model_config(config.model, trust_remote_code=config.trust_remote_code)
    limit = getattr(model_config, "max_position_embeddings", None)
    if limit is not None and config.seq_len > limit:
        raise ConfigError(f"seq_len: {config.seq_len} exceeds the model's maximum context of {limit} tokens")
    problem = family_problem(config.method, FAMILIES[model_config.model_type].experts is not None)
    if problem:
        raise ConfigError(f"method: {problem} ({config.model} is {model_config.model_type})")
    layers = model_config.num_hidden_layers
    for name in ("blockwise_layer_start", "blockwise_layer_end"):
        value = getattr(config, name)
        if value is not None and value > layers:
            raise ConfigError(f"{name}: {value} is beyond the model's {layers} layers")


def family_problem(method: str, mixture: bool) -> str | None:
    """Why `method` does not prune a model of this kind (a mixture of experts or dense), or None."""
    if method == "experts" and not mixture:
        return f"experts removes a mixture's experts, and this model is dense: use {', '.join(WIDTH_METHODS)} or depth"
    if mixture and method != "experts":
        return f"{method} prunes dense layers, and this model is a mixture of experts: use experts"
    return None


def make_plan(config: PruneConfig, scores: GroupScores | None, layout: ModelLayout, loss=None,
              similarity: LayerSimilarity | None = None) -> PrunePlan:
    """The method's plan, made uniform if the config asks, validated (PlanError when it cannot be had). `loss`: a
    candidate plan's measured calibration loss, for what measures (blockwise_attention measured_loss, the uniform
    layout's attention count, depth's measured_loss). With a depth_share, a mixed cut (pruning/mixed.py):
    `similarity` is its layers' measure."""
    if config.depth_share:
        plan_ = _mixed(config, scores, layout, loss, similarity)
    else:
        plan_ = _width(config, scores, layout, config.sparsity, loss)
    plan_.validate(layout)
    return plan_


def _width(config: PruneConfig, scores: GroupScores | None, layout: ModelLayout, sparsity: float, loss,
           options: PlanOptions | None = None) -> PrunePlan:
    options = options or PlanOptions.of(config, plan_loss=loss)
    plan_ = METHODS[config.method].plan(scores, layout, replace(options, sparsity=sparsity, plan_loss=loss))
    align = config.servable_align
    if config.uniform or align:
        scores = drawn_scores(layout, config.seed) if scores is None else scores
    if config.uniform:
        plan_ = uniform_plan(plan_, scores, layout, sparsity, config.uniform_multiple, loss)
    elif align:
        plan_ = aligned_plan(plan_, scores, layout, align, "align" if config.align else "servable")
    return plan_


def _mixed(config: PruneConfig, scores, layout: ModelLayout, loss, similarity) -> PrunePlan:
    depth = config.model_copy(update={"method": "depth", "sparsity": config.sparsity * config.depth_share,
                                      "depth_share": 0.0, "uniform": False})
    removed = METHODS["depth"].plan(similarity, layout, PlanOptions.of(depth, plan_loss=loss)).layers_removed
    kept = [i for i in range(layout.num_layers) if i not in removed]
    options = PlanOptions.of(config)
    options = replace(options, blockwise_layer_start=reindexed(options.blockwise_layer_start, removed),
                      blockwise_layer_end=reindexed(options.blockwise_layer_end, removed))

    def width(reduced: ModelLayout, sparsity: float, to_full) -> PrunePlan:
        measured = None if loss is None else (lambda candidate: loss(to_full(candidate)))
        return _width(config, kept_scores(scores, kept), reduced, sparsity, measured, options)

    return mixed_plan(removed, layout, config.sparsity, width, config.method)


def meta_model(model: str, *, trust_remote_code: bool = False) -> torch.nn.Module:
    """A model built from its config alone on the meta device (its modules and shapes; no weights, no memory)."""
    config = load_model_config(model, trust_remote_code=trust_remote_code)
    with building(), torch.device("meta"):
        return held_split(AutoModelForCausalLM.from_config(config))


def meta_layout(model: str, *, trust_remote_code: bool = False) -> ModelLayout:
    """A model's layout from its config alone (`meta_model`)."""
    return describe_layout(meta_model(model, trust_remote_code=trust_remote_code))


def check_plan(config: PruneConfig, layout: ModelLayout) -> None:
    """PlanError if no plan of `config` exists on `layout` whatever the scores (planned from equal scores, a
    measured loss of 0; for depth, equal hidden states); first, a method that does not prune this kind of model."""
    problem = family_problem(config.method, bool(layout.experts))
    if problem:
        raise PlanError(problem)
    scores = GroupScores(attn=tuple(np.ones(g) for g in layout.attn_groups),
                         mlp=tuple(np.ones(c) for c in layout.mlp_channels))
    similarity = LayerSimilarity(np.ones(layout.num_layers), np.ones((layout.num_layers + 1, 1, 1)))
    if METHODS[config.method].scored_by is Scoring.LAYERS and not uses_gradients(config):  # depth's taylor: groups
        scores = similarity
    if METHODS[config.method].scored_by is Scoring.EXPERTS:
        scores = tuple(np.ones(count) for count in layout.experts)
    make_plan(config, scores, layout, loss=lambda candidate: 0.0, similarity=similarity)


def start(config: PruneConfig, *, cache: ImportanceCache | None = None, sample_counts=(),
          pruned_folder: Path | None = None, kept_folder: Path | None = None) -> Pruning:
    """Checks against the model's config and its tokenizer, before anything heavy. With `pruned_folder` the pruning
    is streamed (`config.streaming` resolved by the caller, who knows the trial's memory): the model held one
    layer at a time, the pruned model written there and read back from it layer by layer; with `kept_folder` its
    passes keep what they carry between layers in that folder instead of the host's memory."""
    check_against_model(config)
    if pruned_folder is not None:
        problem = config.streaming_problem()
        if problem:
            raise ConfigError(f"streaming: {config.model} does not fit in memory, so it streams, but {problem}")
        streamable(config.model, trust_remote_code=config.trust_remote_code)  # what cannot be streamed, refused now
    tokenizer = load_tokenizer(config.model, trust_remote_code=config.trust_remote_code)
    return Pruning(config, tokenizer, Calibration(config, tokenizer), cache, tuple(sample_counts),
                   streamed=pruned_folder is not None, pruned_folder=pruned_folder, kept_folder=kept_folder)


def load(pruning: Pruning) -> dict[str, float]:
    """The weights, on the config's device and dtype; without a cache the gradient pass's calibration is drawn
    first, so a draw that cannot be had fails before the weights are read."""
    config, timings = pruning.config, {}
    if uses_gradients(config) and pruning.cache is None:
        pruning.calibration.ids()
        timings["calibration_s"] = pruning.calibration.seconds
    begin = time.perf_counter()
    device = resolve_device(config.device)
    if pruning.streamed:  # the head now, each layer when it is needed
        pruning.model = stream_model(config.model, device=device, dtype=resolve_dtype(config.dtype, device),
                                     trust_remote_code=config.trust_remote_code)
        pruning.model.scratch = pruning.kept_folder
        pruning.layout = describe_layout(pruning.model.skeleton())
    else:
        pruning.model = load_model(config.model, device=device, dtype=resolve_dtype(config.dtype, device),
                                   trust_remote_code=config.trust_remote_code, seed=config.seed)
        pruning.layout = describe_layout(pruning.model)
    log.info("loaded %s: %d parameters, %d layers on %s", config.model, pruning.layout.total_params,
             pruning.layout.num_layers, device)
    return timings | {"load_s": time.perf_counter() - begin}


def score(pruning: Pruning) -> dict[str, float]:
    """What the method ranks, through the importance service (the shared cache when the pruning has one)."""
    scored = score_groups(pruning.model, pruning.layout, pruning.calibration, cache=pruning.cache,
                          sample_counts=pruning.sample_counts)
    pruning.scores, pruning.importance, pruning.importance_cache = scored.scores, scored.importance, scored.cache_event
    pruning.similarity, pruning.activations = scored.similarity, scored.activations
    return scored.timings


def plan(pruning: Pruning) -> dict[str, float]:
    """The plan (pure but for a measured loss, which masks the loaded model on the calibration rows)."""
    begin, config = time.perf_counter(), pruning.config
    loss = plan_loss(pruning.model, pruning.calibration.ids, config.micro_batch_size)
    pruning.plan = make_plan(config, pruning.scores, pruning.layout, loss, pruning.similarity)
    return {"plan_s": time.perf_counter() - begin}


def apply(pruning: Pruning) -> dict[str, float]:
    """The plan applied to the model in place, and the diagnostics of what was removed."""
    begin, config, importance = time.perf_counter(), pruning.config, pruning.importance
    compensate = config.criterion == "flap" and config.flap_compensation and pruning.activations is not None
    deltas = compensations(pruning.model, pruning.plan, pruning.activations) if compensate else None
    if pruning.streamed:  # written layer by layer, then held layer by layer from there
        shutil.rmtree(pruning.pruned_folder, ignore_errors=True)  # a retried trial's half-written folder
        save_pruned_streamed(pruning.model, pruning.plan, pruning.pruned_folder, source_model=config.model)
        pruning.model = stream_model(str(pruning.pruned_folder), device=pruning.model.device,
                                     dtype=pruning.model.dtype)
        pruning.model.scratch = pruning.kept_folder
    else:
        apply_plan(pruning.model, pruning.plan)
    if deltas is not None:
        add_compensation(pruning.model, deltas, pruning.plan.layers_removed)
    pruning.diagnostics = pruning_diagnostics(
        pruning.layout, pruning.plan, sparsity=config.target_sparsity, extreme_threshold=config.extreme_threshold,
        grad_mean=None if importance is None else importance.grad_mean,
        grad_norm=None if importance is None else importance.grad_norm,
    )
    seconds = time.perf_counter() - begin
    # prune_s: planning and applying together, the column sweeps have always reported
    return {"apply_s": seconds, "prune_s": pruning.timings.get("plan_s", 0.0) + seconds}


STAGES = (load, score, plan, apply)


def prune(config: PruneConfig, *, cache: ImportanceCache | None = None, sample_counts=(),
          pruned_folder: Path | None = None) -> Pruning:
    """Run one pruning as `config` says; nothing is written to disk (see artifacts.write_prune_artifacts), but for
    a streamed pruning's model, written to `pruned_folder` (`start`)."""
    pruning = start(config, cache=cache, sample_counts=sample_counts, pruned_folder=pruned_folder)
    for stage in STAGES:
        pruning.timings |= stage(pruning)
    return pruning


def summary_dict(config: PruneConfig, result: Pruning) -> dict:
    """pruning_summary.json: the config, the diagnostics, every removed group and the stages' seconds."""
    return {
        "config": config.model_dump(),
        "method": result.plan.method,
        **result.diagnostics,
        "layers_removed": list(result.plan.layers_removed),
        "removed_groups": [
            {"layer": i, "attention_groups": list(a), "mlp_channels": list(m)}
            | ({"experts": list(result.plan.experts_removed[i])} if result.plan.experts_removed else {})
            for i, (a, m) in enumerate(zip(result.plan.attn_removed, result.plan.mlp_removed))
        ],
        "group_params": {
            "attention_group": result.layout.attn_group_params,
            "mlp_channel": result.layout.mlp_channel_params,
        } | ({"expert": result.layout.expert_params} if result.layout.experts else {}),
        "timings_s": result.timings,
    }


# A trial's columns of its pruning (docs/specification.md §3): what was removed and the gradient statistics' spread
SUMMARY_COLUMNS = ("params_count", "params_count_before", "pruning_ratio", "extreme_pruning_layers", "grad_mean_ratio",
                   "grad_norm_ratio", "grad_mean_range", "grad_norm_range")
# a mixture's besides: the parameters a token computes with, before and after
MIXTURE_COLUMNS = ("active_params_count", "active_params_count_before")


def write_summary(pruning: Pruning, folder: Path) -> dict:
    """A trial's record of its pruning: pruning_summary.json and layer_analysis.json in `folder`; returns the
    pruning's columns (SUMMARY_COLUMNS, and the shared importance cache's event when there is a cache)."""
    summary, layers = summary_dict(pruning.config, pruning), layer_analysis(pruning.diagnostics)
    write_json(folder / "pruning_summary.json", summary)
    write_json(folder / "layer_analysis.json", layers)
    columns = {k: pruning.diagnostics[k] for k in SUMMARY_COLUMNS + MIXTURE_COLUMNS if k in pruning.diagnostics}
    return columns | ({} if pruning.importance_cache is None else {"importance_cache": pruning.importance_cache})
