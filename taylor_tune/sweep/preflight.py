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


def check_plans(experiment: Experiment) -> None:
    """Every method of the space reaches the sweep's sparsity on every model (PlanError -> one line)."""
    trust = bool(experiment.prune.get("trust_remote_code"))
    methods = experiment.search_space.pruning_method.values
    for model in experiment.models:
        with torch.device("meta"):
            layout = describe_layout(
                AutoModelForCausalLM.from_config(load_model_config(model, trust_remote_code=trust))
            )
        scores = GroupScores(attn=tuple(np.ones(g) for g in layout.attn_groups),
                             mlp=tuple(np.ones(c) for c in layout.mlp_channels))
        for method in methods:
            config = experiment.prune_config(model, method, min(experiment.search_space.taylor_seq_len.values),
                                             min(experiment.search_space.taylor_num_samples.values), 0)
            try:
                make_plan(config, scores, layout, loss=lambda plan: 0.0)  # feasibility only: no model here
            except PlanError as error:
                raise ConfigError(
                    f"prune: {method} on {model} cannot be planned with these settings: {error}"
                ) from None


def check_calibration_sizes(experiment: Experiment) -> None:
    """Each model's calibration text holds the largest draw of the space (seq_len x num_samples tokens)."""
    trust = bool(experiment.prune.get("trust_remote_code"))
    longest = max(experiment.search_space.taylor_seq_len.values)
    most = max(experiment.search_space.taylor_num_samples.values)
    methods = experiment.search_space.pruning_method.values
    criterion = experiment.prune_config(experiment.models[0], methods[0], longest, most, 0).criterion  # fixed per sweep
    if criterion not in GRADIENT_CRITERIA or all(METHODS[m].scored_by != "criterion" for m in methods):
        return  # no point of the space draws calibration
    for model in experiment.models:
        config = experiment.prune_config(model, methods[0], longest, most, 0)
        try:
            load_calibration(load_tokenizer(model, trust_remote_code=trust), resolve_text(config.calibration, model),
                             seq_len=longest, num_samples=most, seed=0)
        except CalibrationError as error:
            raise ConfigError(f"search_space: the largest draw of {model} ({most} x {longest} tokens) does not fit: "
                              f"{error}") from None

