"""One pruning run, start to finish and without Ray: validate -> calibrate -> importance -> plan -> apply.

Every check that can fail on user input runs before the weights are loaded: the config (pydantic), the
model's config (architecture, context length), the tokenizer and the calibration draw.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from taylor_tune.config import PruneConfig
from taylor_tune.errors import ConfigError
from taylor_tune.pruning.apply import apply_plan
from taylor_tune.pruning.diagnostics import pruning_diagnostics
from taylor_tune.pruning.groups import describe_layout
from taylor_tune.pruning.importance import (
    GRADIENT_CRITERIA,
    Importance,
    compute_importance,
    magnitude_scores,
    taylor_criterion,
)
from taylor_tune.pruning.measured import plan_loss
from taylor_tune.pruning.methods import METHODS, PlanOptions
from taylor_tune.pruning.methods.random import drawn_scores
from taylor_tune.pruning.plan import GroupScores, ModelLayout, PrunePlan
from taylor_tune.pruning.uniform import uniform_plan
from taylor_tune.sources.calibration import load_calibration
from taylor_tune.sources.data import check_calibration, resolve_text
from taylor_tune.sources.models import load_model, load_model_config, load_tokenizer, resolve_device, resolve_dtype

log = logging.getLogger(__name__)


@dataclass
class PruneResult:
    model: torch.nn.Module  # pruned, in place
    tokenizer: object
    layout: ModelLayout  # of the model before pruning
    plan: PrunePlan
    importance: Importance | None  # None for methods that use no gradients
    calibration_ids: torch.Tensor | None
    diagnostics: dict
    timings: dict[str, float]
    importance_cache: str | None = None  # what a shared importance cache did (hit, miss, ...); None without one


@dataclass(frozen=True)
class ProvidedImportance:
    """What an importance provider hands back: the importance at config.num_samples, the calibration tokens it
    drew (None when a cache hit drew none), what its cache did, and its stage timings (importance_s, and
    calibration_s when it drew calibration)."""

    importance: Importance
    calibration_ids: torch.Tensor | None = None
    cache_event: str | None = None
    timings: dict[str, float] = field(default_factory=dict)


def plan_options(config: PruneConfig) -> PlanOptions:
    return PlanOptions(
        sparsity=config.sparsity,
        layerwise_max_ratio=config.layerwise_cap,
        blockwise_layer_start=config.blockwise_layer_start,
        blockwise_layer_end=config.blockwise_layer_end,
        blockwise_attention=config.blockwise_attention,
        criterion=config.criterion,
        seed=config.seed,
    )


def make_plan(config: PruneConfig, scores: GroupScores | None, layout: ModelLayout,
              loss: Callable[[PrunePlan], float] | None = None) -> PrunePlan:
    """The method's plan, made uniform if the config asks, validated (PlanError when it cannot be had). `loss`: a
    candidate plan's measured calibration loss, for what measures (blockwise_attention measured_loss, the uniform
    layout's attention count)."""
    options = dataclasses.replace(plan_options(config), plan_loss=loss)
    plan = METHODS[config.method].plan(scores, layout, options)
    if config.uniform:
        scores = drawn_scores(layout, config.seed) if scores is None else scores
        plan = uniform_plan(plan, scores, layout, config.sparsity, config.uniform_multiple, loss)
    plan.validate(layout)
    return plan


def check_against_model(config: PruneConfig) -> None:
    """Checks that need the calibration source to exist and the model's config (not its weights)."""
    check_calibration(config.calibration)
    model_config = load_model_config(config.model, trust_remote_code=config.trust_remote_code)
    limit = getattr(model_config, "max_position_embeddings", None)
    if limit is not None and config.seq_len > limit:
        raise ConfigError(f"seq_len: {config.seq_len} exceeds the model's maximum context of {limit} tokens")
    layers = model_config.num_hidden_layers
    for name in ("blockwise_layer_start", "blockwise_layer_end"):
        value = getattr(config, name)
        if value is not None and value > layers:
            raise ConfigError(f"{name}: {value} is beyond the model's {layers} layers")


# Given the loaded model, its layout and tokenizer: the importance at config.num_samples, and how it was had.
ImportanceProvider = Callable[[torch.nn.Module, ModelLayout, object], ProvidedImportance]


def prune(config: PruneConfig, *, importance_provider: ImportanceProvider | None = None) -> PruneResult:
    """Run one pruning as `config` says; nothing is written to disk (see artifacts.write_prune_artifacts).

    `importance_provider` replaces the calibration draw and gradient pass (the sweep's shared cache uses it).
    """
    timings: dict[str, float] = {}
    method = METHODS[config.method]
    check_against_model(config)
    tokenizer = load_tokenizer(config.model, trust_remote_code=config.trust_remote_code)
    device = resolve_device(config.device)
    calibration_ids = None
    uses_gradients = method.scored_by == "criterion" and config.criterion in GRADIENT_CRITERIA
    if uses_gradients and importance_provider is None:
        start = time.perf_counter()
        calibration_ids = load_calibration(
            tokenizer,
            resolve_text(config.calibration, config.model),
            seq_len=config.seq_len,
            num_samples=config.num_samples,
            seed=config.seed,
        )
        timings["calibration_s"] = time.perf_counter() - start

    start = time.perf_counter()
    model = load_model(
        config.model, device=device, dtype=resolve_dtype(config.dtype, device),
        trust_remote_code=config.trust_remote_code, seed=config.seed,
    )
    layout = describe_layout(model)
    timings["load_s"] = time.perf_counter() - start
    log.info("loaded %s: %d parameters, %d layers on %s", config.model, layout.total_params, layout.num_layers, device)

    importance, scores, provided = None, None, None
    start = time.perf_counter()
    if uses_gradients:
        if importance_provider is not None:
            provided = importance_provider(model, layout, tokenizer)
            importance, calibration_ids = provided.importance, provided.calibration_ids
        else:
            importance = compute_importance(model, layout, calibration_ids, micro_batch_size=config.micro_batch_size)[
                config.num_samples
            ]
        scores = taylor_criterion(importance.scores, layout, config.criterion)
    elif method.scored_by in ("criterion", "weights"):  # a weight-magnitude criterion (l1/l2), or the magnitude method
        scores = magnitude_scores(model, layout, p=1 if config.criterion == "l1" else 2)
    timings["importance_s"] = time.perf_counter() - start
    if provided is not None:
        timings |= provided.timings  # the provider's own split of its time into calibration and importance

    start = time.perf_counter()
    drawn = {"ids": calibration_ids}

    def ids() -> torch.Tensor:  # only when a plan is measured; a cache hit or a method without gradients drew none
        if drawn["ids"] is None:
            drawn["ids"] = load_calibration(tokenizer, resolve_text(config.calibration, config.model),
                                            seq_len=config.seq_len, num_samples=config.num_samples, seed=config.seed)
        return drawn["ids"]

    plan = make_plan(config, scores, layout, plan_loss(model, ids, config.micro_batch_size))
    calibration_ids = drawn["ids"]
    apply_plan(model, plan)
    timings["prune_s"] = time.perf_counter() - start

    diagnostics = pruning_diagnostics(
        layout, plan, sparsity=config.sparsity, extreme_threshold=config.extreme_threshold,
        grad_mean=None if importance is None else importance.grad_mean,
        grad_norm=None if importance is None else importance.grad_norm,
    )
    return PruneResult(model, tokenizer, layout, plan, importance, calibration_ids, diagnostics, timings,
                       None if provided is None else provided.cache_event)
