"""A sweep, as its YAML file states it: models, search space, search strategy, fixed settings, resources.

Validated before Ray starts (no torch, no ray here): unknown keys, wrong types, an empty grid, unknown methods
or tasks all name the field; then `check_sources`, `check_models` and `check_storage` check what the file names
exists. The search space may be inline or a file under search_spaces/ (see search_spaces/README.md).
"""

from __future__ import annotations

import math
import os
from itertools import product
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from taylor_tune.config import (
    EXPERT_FIELDS,
    Evaluation,
    PruneConfig,
    RecoverySpec,
    check_typed,
    dimensions,
    format_validation_error,
    load_yaml,
    read_config_file,
    recovery_of,
)
from taylor_tune.errors import ConfigError, TaylorTuneError, shown
from taylor_tune.schema import (
    DIMENSIONS,
    RACE_OBJECTIVES,
    RECOVERY_DIMENSIONS,
    SPEED_METRICS,
    better,
    objective_metrics,
    prune_dimensions,
)
from taylor_tune.sources.assets import MODEL_ASSETS, asset_dir
from taylor_tune.sources.data import TRAINED_MODELS, check_calibration, check_eval_sources, heldout_paths
from taylor_tune.sources.instructions import check_instruction_file, is_instruction_data
from taylor_tune.sources.world import model_dir

Value = StrictBool | StrictInt | StrictFloat | StrictStr | None


class Domain(BaseModel):
    """One dimension: `grid` (every value, for grid search) or `choice` (sampled by TPE / random search)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # strict: YAML's `true` is not the integer 1, nor "1" a number
    grid: tuple[Value, ...] | None = None
    choice: tuple[Value, ...] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> Domain:
        if (self.grid is None) == (self.choice is None):
            raise ValueError("give exactly one of grid or choice")
        if not self.values:
            raise ValueError("empty list of values")
        if len(set(map(repr, self.values))) < len(self.values):
            raise ValueError(f"a value is listed twice: {list(self.values)}")
        return self

    @property
    def values(self) -> tuple:
        return self.grid if self.grid is not None else self.choice


class SearchSpaceRules(BaseModel):
    """Any pruning setting may be a dimension (`DIMENSIONS`: the paper's three under the source tables' names, the
    rest under PruneConfig's); a setting not searched is fixed by `prune` or keeps its default. Each value is checked
    as that PruneConfig field (strictly: no coercion), every combination of them with `prune` as a whole config.
    The recovery settings (`RECOVERY_DIMENSIONS`) are dimensions too, checked as RecoverySpec fields, when the
    experiment recovers. The fields, one per dimension, are made by `search_space_class` from the configuration
    classes' marked fields (`config.searchable`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    prune_class: ClassVar[type[BaseModel]] = PruneConfig
    recovery_class: ClassVar[type[BaseModel]] = RecoverySpec
    dimensions: ClassVar[dict[str, str]] = {}
    recovery_dimensions: ClassVar[dict[str, str]] = {}

    @classmethod
    def searchable(cls) -> tuple[str, ...]:
        return (*cls.dimensions, *cls.recovery_dimensions)

    @model_validator(mode="before")
    @classmethod
    def _known(cls, data):
        if isinstance(data, dict):
            unknown = [k for k in data if k not in cls.searchable()]
            if unknown:
                raise ValueError(f"unknown dimension {shown(unknown[0])}; a search may vary "
                                 f"{', '.join(cls.searchable())}")
        return data

    @field_validator("*")
    @classmethod
    def _values(cls, domain: Domain | None, info: ValidationInfo) -> Domain | None:
        name = info.field_name
        for value in () if domain is None else domain.values:
            try:  # alone: the field's own type and range; combinations are the experiment's check
                if name in cls.recovery_dimensions:
                    cls.recovery_class.model_validate({cls.recovery_dimensions[name]: value}, strict=True)
                else:  # an expert setting beside the one method that reads it
                    field = cls.dimensions[name]
                    alone = {"method": "experts"} if field in EXPERT_FIELDS else {}
                    cls.prune_class.model_validate({"model": "tiny-llama", **alone, field: value}, strict=True)
            except ValidationError as error:
                raise ValueError(f"{error.errors()[0]['msg'].removeprefix('Value error, ')} (got {shown(value)})") \
                    from None
        return domain

    def domains(self) -> dict[str, Domain]:
        """The searched dimensions, in their order (pruning's, then recovery's)."""
        return {name: getattr(self, name) for name in self.searchable() if getattr(self, name) is not None}


def search_space_class(prune_class: type[BaseModel] = PruneConfig,
                       recovery_class: type[BaseModel] = RecoverySpec) -> type[SearchSpaceRules]:
    """The search space's model: one optional Domain per searchable field of the two configuration classes."""
    rules = type("SearchSpaceRules", (SearchSpaceRules,), {"__module__": __name__,
        "prune_class": prune_class, "recovery_class": recovery_class,
        "dimensions": prune_dimensions(prune_class), "recovery_dimensions": dimensions(recovery_class)})
    fields = {name: (Domain | None, None) for name in rules.searchable()}
    return create_model("SearchSpace", __base__=rules, __module__=__name__, **fields)


SearchSpace = search_space_class()


class Search(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    algorithm: Literal["grid", "tpe"] = "grid"
    scheduler: Literal["none", "asha", "race"] = "none"
    num_trials: int = Field(1, gt=0, description="tpe: trials per model; grid: ignored (the grid decides)")
    repeats: int = Field(1, gt=0, description="calibration seeds per configuration (seeds 0..repeats-1)")
    seed: int = 0
    max_concurrent: int | None = Field(None, gt=0)
    n_startup_trials: int = Field(
        10, ge=0, description="tpe: random trials per model before TPE models the results (Optuna's default)"
    )
    reduction_factor: float = Field(
        2,
        ge=2,
        allow_inf_nan=False,
        description="asha: each cheap zero-shot pass lets the best 1/reduction_factor of the trials seen there go on",
    )
    alpha: float = Field(
        0.05, gt=0, lt=0.5, description="race: after each cheap zero-shot pass (perplexity pass, when the metric is "
                                        "ppl) a trial stops when a one-sided paired test on the items (windows) it "
                                        "shares with the incumbent says it is worse at this level"
    )


# The smallest share of a CPU or GPU a trial may ask for: Ray keeps resource amounts to 4 decimals and refuses less.
MIN_RESOURCE = 0.01


class Resources(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    cpu: float = Field(1, ge=MIN_RESOURCE, allow_inf_nan=False, description=f"per trial, at least {MIN_RESOURCE}")
    gpu: float | Literal["auto"] = Field("auto", description="per trial; auto = 1 where the cluster has GPUs, else 0")
    memory: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="GiB of host memory per trial: Ray starts no more trials on a "
        "node at once than its memory holds, and a CPU trial whose estimated peak is larger is refused before Ray "
        "starts; default: no reservation, and a CPU trial may use the machine's memory")

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, value):
        if value != "auto" and not (value == 0 or MIN_RESOURCE <= value < math.inf):
            raise ValueError(f"auto, 0, or a finite share of at least {MIN_RESOURCE}")
        return value


class ObjectiveSpec(BaseModel):
    """One objective of a multi-objective search: a reported metric and the direction in which it is better
    (default: its natural one, max for accuracies and speedups, min for ppl and memory_ratio)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    metric: str
    mode: Literal["max", "min"]

    @model_validator(mode="before")
    @classmethod
    def _natural_mode(cls, data):
        if isinstance(data, dict) and "mode" not in data and isinstance(data.get("metric"), str):
            data = {**data, "mode": better(data["metric"])}
        return data


# A whole space is checked combination by combination before Ray starts; beyond this many per model, refused.
MAX_SPACE = 100_000


class Experiment(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # one path component under storage_path: not "." or "..", no separator
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=100)
    models: tuple[str, ...] = Field(min_length=1)
    search_space: SearchSpace
    search: Search = Search()
    prune: dict[str, Any] = Field(default_factory=dict, description="fixed PruneConfig fields for every trial")
    evaluation: Evaluation = Evaluation()
    # LoRA recovery after pruning, before the evaluation (None: off, the paper grid's protocol)
    recovery: RecoverySpec | None = None
    resources: Resources = Resources()
    max_failures: int = Field(1, ge=0)
    metric: str = Field(
        "acc_mean", description="what the search optimizes and the report ranks by: acc_mean, ppl, acc_<task>, "
        "params_count, pruning_ratio, or with evaluation.speed a speedup or memory_ratio"
    )
    mode: Literal["max", "min"] = Field("max", description="the metric's better direction: max for accuracies and "
                                        "speedups, min for ppl, params_count and memory_ratio")
    objectives: tuple[ObjectiveSpec, ...] | None = Field(
        None, min_length=1, description="several objectives at once, e.g. [{metric: acc_mean}, {metric: "
        "decode_speedup}]: a multi-objective search (TPE per model, or the grid) and the Pareto front in the report; "
        "the first is the one `metric` names (given instead of metric/mode)",
    )
    storage_path: str = "runs/sweeps"

    @model_validator(mode="before")
    @classmethod
    def _primary(cls, data):
        """With `objectives`, `metric` and `mode` are the first one's (Tune, status and single-metric statistics
        rank by it)."""
        if isinstance(data, dict) and data.get("objectives") is not None:
            if "metric" in data or "mode" in data:
                raise ValueError("give objectives or metric and mode, not both (the first objective is the metric)")
            listed = data["objectives"]
            first = listed[0] if isinstance(listed, (list, tuple)) and listed else {}
            if isinstance(first, dict) and isinstance(first.get("metric"), str):
                data = {**data, "metric": first["metric"], "mode": first.get("mode", better(first["metric"]))}
        return data

    @field_validator("models")
    @classmethod
    def _distinct(cls, models: tuple[str, ...]) -> tuple[str, ...]:
        # one folder spelled two ways (a/model, a/./model, ./a/model) is one model: its trials would run twice and
        # read as two models, or as two seeds of one configuration
        keys = [_model_key(m) for m in models]
        twice = next((i for i, key in enumerate(keys) if key in keys[:i]), None)
        if twice is not None:
            first = models[keys.index(keys[twice])]
            said = "" if first == models[twice] else f" (as {shown(first)} and {shown(models[twice])})"
            raise ValueError(f"{shown(first)} is listed twice{said}; list each model once (search.repeats "
                             "gives seeds)")
        return models

    @field_validator("prune")
    @classmethod
    def _prune(cls, values: dict) -> dict:
        reserved = {"model", "seed"} & set(values)
        if reserved:
            raise ValueError(f"{sorted(reserved)[0]!r} is set by the sweep (models, search.repeats), not in prune")
        try:
            check_typed(values)
        except ConfigError as error:
            raise ValueError(str(error)) from None
        PruneConfig(model="tiny-llama", **values)
        return values

    @property
    def objective_list(self) -> tuple[tuple[str, str], ...]:
        """(metric, mode) of every objective, the primary first."""
        if self.objectives:
            return tuple((o.metric, o.mode) for o in self.objectives)
        return ((self.metric, self.mode),)

    @model_validator(mode="after")
    def _objective(self) -> Experiment:
        speed = self.evaluation.speed is not None
        allowed = objective_metrics(self.evaluation.tasks, speed=speed)
        field = "objectives" if self.objectives else "metric"
        metrics = [metric for metric, _ in self.objective_list]
        for metric, mode in self.objective_list:
            if metric not in allowed:
                why = " (speed metrics need evaluation.speed)" if metric in SPEED_METRICS and not speed else ""
                raise ValueError(f"{field}: {shown(metric)} is not reported by these trials{why}; "
                                 f"one of {', '.join(allowed)}")
            if metric == "ppl" and self.evaluation.ppl is None:
                raise ValueError(f"{field}: ppl needs evaluation.ppl (a perplexity text such as wiki or wikitext2)")
            if mode != better(metric):
                raise ValueError(f"mode: {mode!r} would search for the worst {metric}; use mode: {better(metric)}")
            if metrics.count(metric) > 1:
                raise ValueError(f"objectives: {metric} is listed twice")
        if len(metrics) > 1 and self.search.scheduler in ("asha", "race"):
            raise ValueError(f"search.scheduler: {self.search.scheduler} stops trials by one metric and cannot rank "
                             f"several objectives; use scheduler: none with objectives (or one metric with "
                             f"{self.search.scheduler})")
        if self.search.scheduler == "race" and metrics[0] not in RACE_OBJECTIVES:
            raise ValueError(f"search.scheduler: race compares trials item by item (zero-shot items or perplexity "
                             f"windows), so it ranks by acc_mean or ppl, not {metrics[0]}; use asha for {metrics[0]}")
        return self

    @model_validator(mode="after")
    def _space(self) -> Experiment:
        """Each setting is either searched or fixed, and every combination of the space is a valid pruning."""
        for name in self.search_space.domains():
            if name in RECOVERY_DIMENSIONS:
                field = RECOVERY_DIMENSIONS[name]
                if self.recovery is None:
                    raise ValueError(f"search_space.{name} searches a recovery setting, and the experiment does not "
                                     "recover; add a recovery block (recovery: {} for its defaults)")
                if field in self.recovery.model_fields_set:
                    raise ValueError(f"recovery.{field} is also searched (search_space.{name}): fix it in recovery "
                                     "or search it, not both")
            elif DIMENSIONS[name] in self.prune:
                raise ValueError(f"prune.{DIMENSIONS[name]} is also searched (search_space.{name}): fix it in prune "
                                 "or search it, not both")
        if self.space_size() > MAX_SPACE:
            raise ValueError(f"search_space: {self.space_size()} configurations per model; at most {MAX_SPACE}")
        if self.space_size() * self.search.repeats > MAX_SPACE:
            raise ValueError(f"search.repeats: {self.search.repeats} seeds x {self.space_size()} configurations = "
                             f"{self.space_size() * self.search.repeats} trials per model; at most {MAX_SPACE}")
        for point in self.space_points():
            try:
                self.prune_config("tiny-llama", point)
                self.recovery_spec(point)
            except ValidationError as error:
                message = error.errors()[0]["msg"].removeprefix("Value error, ")
                named = ", ".join(f"{k} {v!r}" for k, v in point.items())
                what = "recovery" if error.title == RecoverySpec.__name__ else "pruning"
                raise ValueError(f"search_space: the combination ({named}) is not a valid {what}: {message}") \
                    from None
        return self

    @model_validator(mode="after")
    def _tpe(self) -> Experiment:
        if self.search.algorithm == "tpe" and self.search.repeats > 1:
            raise ValueError("search.repeats > 1 is for grid search; TPE draws one calibration seed (0)")
        if self.search.scheduler == "asha" and self.recovery is None and len(self.evaluation.fidelities) < 2:
            raise ValueError(
                "search.scheduler: asha stops trials at a cheap zero-shot pass (or a recovery's held-out loss), and "
                "evaluation.fidelities has only one; give cheaper limits first, e.g. fidelities: [200, null]"
            )
        if self.search.scheduler == "race":
            if self.metric == "ppl" and len(self.evaluation.ppl_fidelities) < 2:
                raise ValueError("search.scheduler: race on ppl stops trials after a cheap perplexity pass, and "
                                 "evaluation.ppl_fidelities has only one; give the blocks' window counts first, e.g. "
                                 "ppl_fidelities: [16, 48, null]")
            if self.metric != "ppl" and len(self.evaluation.fidelities) < 2:
                raise ValueError("search.scheduler: race stops trials after a cheap zero-shot pass, and "
                                 "evaluation.fidelities has only one; give the blocks' sizes first, e.g. "
                                 "fidelities: [50, 150, null]")
            if self.evaluation.item_seed is None:
                raise ValueError("evaluation.item_seed: race compares trials on the same seeded items; null (lm-eval's "
                                 "first N documents) is for asha or none")
        if self.search.algorithm == "grid" and any(d.grid is None for d in self.search_space.domains().values()):
            raise ValueError("search.algorithm grid needs grid domains in the search space (choice is for tpe)")
        if self.search.algorithm == "tpe" and not self.search_space.domains():
            raise ValueError("search.algorithm tpe needs at least one dimension in search_space")
        if self.search.algorithm == "tpe" and self.search.num_trials > self.space_size():
            raise ValueError(
                f"search.num_trials: {self.search.num_trials} is more than the {self.space_size()} configurations "
                "of the search space, and TPE runs each at most once (algorithm: grid runs them all)"
            )
        return self

    def prune_config(self, model: str, point: dict, seed: int = 0) -> PruneConfig:
        """The PruneConfig of one point of the space ({dimension: value}) for `model`."""
        return PruneConfig(model=model, seed=seed, **self.prune,
                           **{DIMENSIONS[k]: v for k, v in point.items() if k in DIMENSIONS})

    def recovery_spec(self, point: dict) -> RecoverySpec | None:
        """The recovery of one point of the space: the recovery block with the point's recovery dimensions."""
        return recovery_of(self.recovery, point)

    def recovery_points(self) -> int:
        """The most held-out loss points a trial's recovery reports (`RecoverySpec.points`; 0 without recovery):
        ASHA's rungs before the zero-shot passes."""
        return max((self.recovery_spec(point).points for point in self.space_points()), default=0) \
            if self.recovery is not None else 0

    def values_of(self, dimension: str) -> tuple:
        """Every value the sweep gives a dimension: the searched ones, or the one fixed in prune (or the default);
        a recovery dimension's fixed value is the recovery block's (none without recovery)."""
        domains = self.search_space.domains()
        if dimension in domains:
            return domains[dimension].values
        if dimension in RECOVERY_DIMENSIONS:
            return () if self.recovery is None else (getattr(self.recovery, RECOVERY_DIMENSIONS[dimension]),)
        field = DIMENSIONS[dimension]
        return (self.prune[field],) if field in self.prune else (PruneConfig.model_fields[field].default,)

    def space_size(self) -> int:
        """Configurations per model in the search space."""
        return math.prod(len(domain.values) for domain in self.search_space.domains().values())

    def space_points(self) -> list[dict]:
        """Every configuration of the space per model: {dimension: value} of the searched dimensions."""
        domains = self.search_space.domains()
        return [dict(zip(domains, combo)) for combo in product(*(d.values for d in domains.values()))]

    def grid_size(self) -> int:
        if self.search.algorithm == "grid":
            return self.space_size() * len(self.models) * self.search.repeats
        return self.search.num_trials * len(self.models) * self.search.repeats

    def sample_counts(self) -> tuple[int, ...]:
        """Every num_samples the search can ask for: one importance pass serves them all (nested)."""
        return tuple(sorted(set(self.values_of("taylor_num_samples"))))

    def grid_points(self) -> list[dict]:
        """Every configuration of a grid search (for checks and benchmarks; Tune expands its own)."""
        return [{"model": m, "seed": s, **point}
                for m in self.models for s in range(self.search.repeats) for point in self.space_points()]


def _resolve_space(data: dict, base: Path) -> dict:
    space = data.get("search_space")
    if isinstance(space, str):
        path = Path(space) if Path(space).is_absolute() else base / space
        if not path.is_file():
            path = Path(space)
        try:
            loaded = load_yaml(path.read_text(encoding="utf-8"))
        except OSError as error:
            raise ConfigError(f"search_space: cannot read {space}: {error.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"search_space: {space} is not a UTF-8 text file") from None
        except yaml.YAMLError as error:  # a syntax error, or a tag such as !!python/object that safe_load refuses
            raise ConfigError(f"search_space: {space} is not valid YAML: {' '.join(str(error).split())[:500]}") \
                from None
        if not isinstance(loaded, dict):  # never echo the file: it may be anything the user pointed at
            raise ConfigError(f"search_space: {space} does not hold a mapping of dimensions "
                              f"(it holds a {type(loaded).__name__})")
        data = dict(data, search_space=loaded)
    return data


def load_experiment(path: str | Path, **overrides: Any) -> Experiment:
    """Read and validate an experiment YAML; `overrides` (e.g. storage_path, name) replace its values."""
    path = Path(path)
    data = read_config_file(path, what="experiment")
    data = _resolve_space(data, path.resolve().parent.parent) | {k: v for k, v in overrides.items() if v is not None}
    try:
        return Experiment(**data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error)) from None


def _model_key(model: str) -> str:
    """What a model spec names: an existing folder or file by its resolved path (a built-in name by the folder it
    loads from: the shipped one of a trained tiny model, the fetched one of a real model), anything else (a hub id,
    a random tiny model) by its normalized spelling."""
    if model in TRAINED_MODELS or model in MODEL_ASSETS:
        folder = model_dir(model) if model in TRAINED_MODELS else asset_dir(model)
        return str(folder.resolve())
    path = Path(model).expanduser()
    try:
        return str(path.resolve()) if path.exists() else os.path.normpath(model)
    except (OSError, ValueError):  # no path at all (too long, a NUL): a spec is what it says
        return model


def check_models(experiment: Experiment) -> None:
    """Each model resolves (built-in, folder or hub id) and its config allows the largest seq_len, the perplexity
    window and the speed measurement's sequences."""
    from taylor_tune.sources.models import load_model_config  # torch: only here, not when the file is validated

    longest = max(experiment.values_of("taylor_seq_len"))
    window = experiment.evaluation.ppl_window if experiment.evaluation.ppl is not None else None
    speed = experiment.evaluation.speed
    timed = None if speed is None else max(speed.prefill_len, speed.prompt_len + speed.new_tokens)
    for model in experiment.models:
        config = load_model_config(model, trust_remote_code=bool(experiment.prune.get("trust_remote_code")))
        limit = getattr(config, "max_position_embeddings", None)
        if limit is not None and longest > limit:
            where = ("search_space.taylor_seq_len" if "taylor_seq_len" in experiment.search_space.domains()
                     else "prune.seq_len")
            raise ConfigError(
                f"{where}: {longest} exceeds the maximum context ({limit}) of {model}"
            )
        if limit is not None and window is not None and window > limit:
            raise ConfigError(
                f"evaluation.ppl_window: {window} is longer than the maximum context ({limit}) of {model}"
            )
        if limit is not None and timed is not None and timed > limit:
            raise ConfigError(f"evaluation.speed: sequences of {timed} tokens (prefill_len, or prompt_len + "
                              f"new_tokens) exceed the maximum context of {model} ({limit} tokens)")


def check_sources(experiment: Experiment) -> None:
    """What the fixed settings name exists: the calibration text, the evaluation's text and task files, and the
    recovery text, which must not be a held-out text the evaluation scores."""
    for calibration in experiment.values_of("calibration"):
        check_calibration(calibration)
    check_eval_sources(experiment.evaluation)
    searched = "recovery_data" in experiment.search_space.domains()
    for data in experiment.values_of("recovery_data"):
        check_recovery_text(data, experiment.evaluation.ppl, "search_space.recovery_data" if searched else None)


def check_recovery_text(data: str, ppl: str | None, where: str | None = None) -> None:
    """The recovery text exists (fetched, for an asset) and is none of the held-out texts: training on what the
    perplexity scores would make the recovered numbers meaningless."""
    heldout = {p.resolve() for p in heldout_paths()}
    if ppl is not None and Path(ppl).is_file():
        heldout.add(Path(ppl).resolve())
    if Path(data).is_file() and Path(data).resolve() in heldout:
        raise ConfigError(f"{where or 'recovery.data'}: {shown(data)} is held-out text the evaluation scores; "
                          "recover on calibration text (wiki, world, sample, wikitext2, c4) or another file")
    if is_instruction_data(data):
        return check_instruction_file(data, where or "recovery.data")
    try:
        check_calibration(data)
    except TaylorTuneError as error:  # not a file, or an asset not fetched: the same words, naming the field
        raise ConfigError(f"{where or 'recovery.data'}: {str(error).removeprefix('calibration: ')}") from None
