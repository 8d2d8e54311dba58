"""What `prune` checks before it loads weights, checked for every point of a sweep's space before Ray starts.

A trial that cannot succeed (a sparsity no plan reaches, more calibration tokens than the text holds) would
otherwise fail in every try on the cluster, one after another, and exit after the whole sweep. Here each model is
built on the meta device (its shapes, no weights, no memory) and every method of the space plans at the sweep's
sparsity from uniform scores: where a plan is impossible, it is impossible whatever the scores. The largest
calibration draw each model's tokenizer makes is drawn once.
"""

from __future__ import annotations

import os

from taylor_tune.errors import CalibrationError, ConfigError, PlanError
from taylor_tune.pruning.prune import check_plan, draw_calibration, draws_calibration, meta_layout
from taylor_tune.recovery.train import check_recovery_data
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
        layout = meta_layout(model, trust_remote_code=trust)
        for point in points:
            config = experiment.prune_config(model, point)
            try:
                check_plan(config, layout)
            except PlanError as error:
                named = ", ".join(f"{k} {v}" for k, v in point.items() if k != "pruning_method")
                raise ConfigError(
                    f"prune: {config.method} on {model} cannot be planned with these settings"
                    f"{f' ({named})' if named else ''}: {error}"
                ) from None


def check_calibration_sizes(experiment: Experiment) -> None:
    """Each model's calibration text holds the largest draw of the space (seq_len x num_samples tokens)."""
    trust = bool(experiment.prune.get("trust_remote_code"))
    longest = max(experiment.values_of("taylor_seq_len"))
    most = max(experiment.values_of("taylor_num_samples"))
    points = _distinct(experiment, DRAW_FIELDS)
    for model in experiment.models:
        largest = {}  # one draw per text a point reads
        for point in points:
            config = experiment.prune_config(model, point)
            if draws_calibration(config):
                largest.setdefault(resolve_text(config.calibration, model),
                                   config.model_copy(update={"seq_len": longest, "num_samples": most, "seed": 0}))
        for config in largest.values():
            try:
                draw_calibration(config, load_tokenizer(model, trust_remote_code=trust))
            except CalibrationError as error:
                raise ConfigError(f"search_space: the largest draw of {model} ({most} x {longest} tokens) does not "
                                  f"fit: {error}") from None


def memory_bytes() -> int:
    """This machine's physical memory: the bound of what one trial may allocate before its model is even loaded."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_recovery(experiment: Experiment) -> None:
    """Every recovery of the space can do what its settings say, on every model, before Ray starts: a LoRA rank no
    larger than the model's hidden size (every targeted projection has it on one side, so an update's rank cannot
    exceed it: a larger rank only adds memory, 100,000 took 8-10 GB of a 96-wide model), and the recovery data
    (`recovery.train.check_recovery_data`): its size bounded, the text holding the draw, responses kept."""
    if experiment.recovery is None:
        return
    trust = bool(experiment.prune.get("trust_remote_code"))
    specs = {spec.model_dump_json(): spec for spec in map(experiment.recovery_spec, experiment.space_points())}
    for model in experiment.models:
        hidden = load_model_config(model, trust_remote_code=trust).hidden_size
        tokenizer = load_tokenizer(model, trust_remote_code=trust)
        for spec in specs.values():
            if spec.lora_rank > hidden:
                raise ConfigError(f"recovery.lora_rank: {spec.lora_rank} is larger than {model}'s hidden size "
                                  f"{hidden}; a LoRA update's rank cannot exceed it, so a larger rank adds only "
                                  f"memory: choose at most {hidden}")
            try:
                check_recovery_data(tokenizer, spec, model, memory_bytes())
            except CalibrationError as error:
                raise ConfigError(f"{error} (recovery of {model})") from None
