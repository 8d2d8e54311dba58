"""What `prune` checks before it loads weights, checked for every point of a sweep's space before Ray starts.

A trial that cannot succeed (a sparsity no plan reaches, more calibration tokens than the text holds) would
otherwise fail in every try on the cluster, one after another, and exit after the whole sweep. Here each model is
built on the meta device (its shapes, no weights, no memory) and every method of the space plans at the sweep's
sparsity from uniform scores: where a plan is impossible, it is impossible whatever the scores. The largest
calibration draw each model's tokenizer makes is drawn once.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from taylor_tune.errors import CalibrationError, ConfigError, PlanError
from taylor_tune.pruning.groups import describe_layout
from taylor_tune.pruning.importance import GRADIENT_CRITERIA
from taylor_tune.pruning.methods import METHODS
from taylor_tune.pruning.plan import GroupScores
from taylor_tune.pruning.prune import make_plan
from taylor_tune.sources.calibration import load_calibration
from taylor_tune.sources.data import resolve_text
from taylor_tune.sources.models import load_model_config, load_tokenizer
from taylor_tune.sweep.experiment import Experiment

# The dimensions a plan depends on (seq_len, num_samples and the calibration text change the scores, not whether a
# plan exists); and those that decide whether a trial draws calibration at all.
PLAN_FIELDS = ("pruning_method", "sparsity", "layerwise_max_ratio", "blockwise_layer_start", "blockwise_layer_end",
               "blockwise_attention", "criterion", "uniform")
DRAW_FIELDS = ("pruning_method", "criterion", "uniform", "blockwise_attention", "calibration")


def _distinct(experiment: Experiment, fields: tuple[str, ...]) -> list[dict]:
    """The space's points restricted to `fields`, each once."""
    seen = {}
    for point in experiment.space_points():
        part = {k: v for k, v in point.items() if k in fields}
        seen.setdefault(repr(sorted(part.items())), part)
    return list(seen.values())


def check_plans(experiment: Experiment) -> None:
    """Every planning setting of the space reaches its sparsity on every model (PlanError -> one line)."""
    trust = bool(experiment.prune.get("trust_remote_code"))
    points = _distinct(experiment, PLAN_FIELDS)
    for model in experiment.models:
        with torch.device("meta"):
            layout = describe_layout(
                AutoModelForCausalLM.from_config(load_model_config(model, trust_remote_code=trust))
            )
        scores = GroupScores(attn=tuple(np.ones(g) for g in layout.attn_groups),
                             mlp=tuple(np.ones(c) for c in layout.mlp_channels))
        for point in points:
            config = experiment.prune_config(model, point)
            try:
                make_plan(config, scores, layout, loss=lambda plan: 0.0)  # feasibility only: no model here
            except PlanError as error:
                named = ", ".join(f"{k} {v}" for k, v in point.items() if k != "pruning_method")
                raise ConfigError(
                    f"prune: {config.method} on {model} cannot be planned with these settings"
                    f"{f' ({named})' if named else ''}: {error}"
                ) from None


def draws_calibration(config) -> bool:
    """Whether a pruning reads calibration text: gradient scores, or a plan chosen by measured loss."""
    gradient = config.criterion in GRADIENT_CRITERIA and METHODS[config.method].scored_by == "criterion"
    measured = config.uniform or (config.method == "blockwise" and config.blockwise_attention == "measured_loss")
    return gradient or measured


def check_calibration_sizes(experiment: Experiment) -> None:
    """Each model's calibration text holds the largest draw of the space (seq_len x num_samples tokens)."""
    trust = bool(experiment.prune.get("trust_remote_code"))
    longest = max(experiment.values_of("taylor_seq_len"))
    most = max(experiment.values_of("taylor_num_samples"))
    points = _distinct(experiment, DRAW_FIELDS)
    for model in experiment.models:
        texts = {}
        for point in points:
            config = experiment.prune_config(model, point)
            if draws_calibration(config):
                texts.setdefault(resolve_text(config.calibration, model), config.calibration)
        for text in texts:
            try:
                load_calibration(load_tokenizer(model, trust_remote_code=trust), text,
                                 seq_len=longest, num_samples=most, seed=0)
            except CalibrationError as error:
                raise ConfigError(f"search_space: the largest draw of {model} ({most} x {longest} tokens) does not "
                                  f"fit: {error}") from None
