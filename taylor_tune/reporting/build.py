"""The analysis report computed: `build_report` turns any input `load_trials` accepts into a `Report` (pure: no
files, no rendering). For each model the sections follow the source tools' report, plus what they lacked: stderr and
confidence intervals, whether the best lead is real, seed spread, held-out selection, fANOVA importance, the value of
a per-model search, quality against measured speed, the Pareto front of the objectives, the best configuration
under constraints, and what recovery fine-tuning changed. `render` prints a Report, `write` writes its folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import pandas as pd

from taylor_tune.errors import ReportError
from taylor_tune.reporting import pareto, stats
from taylor_tune.reporting.frame import GRAD_COLUMNS, TrialTable, load_trials
from taylor_tune.schema import task_columns


@dataclass
class ModelReport:
    model: str
    trials: int
    valid: pd.DataFrame
    invalid: pd.DataFrame
    tasks: tuple[str, ...]
    methods: dict
    seq_len: dict
    num_samples: dict
    gradient: list[stats.Correlation]
    extreme: dict
    ppl: stats.Correlation
    best: pd.Series | None
    best_stderr: float | None
    lead: stats.Lead
    seeds: dict
    heldout: dict
    speed: pd.DataFrame | None = None  # quality against measured speed, per trial (None: no trial measured it)
    objective: stats.Objective = stats.ACCURACY
    front_objectives: tuple[stats.Objective, ...] = ()  # what the Pareto front trades off (empty: no front)
    front: pd.DataFrame | None = None  # pareto.pareto_front: every configuration, the front first
    constrained: dict | None = None  # pareto.best_under, when constraints were asked for
    recovery: dict | None = None  # stats.recovery_comparison, when the trials recovered
    seed: int = 0  # fANOVA's
    task_tests: dict = field(default_factory=dict)  # stats.task_tests: per task, McNemar of the best vs the runner-up
    # stats.paired_levels of each method, and of each value of seq_len and num_samples, against the best (acc_mean)
    paired: dict = field(default_factory=dict)

    @cached_property
    def importance(self) -> dict:
        """stats.hyperparameter_importance of the valid trials, computed when first read: Optuna's fANOVA is most of
        a report's build time, and a reader after the best configuration or the front need not wait for it."""
        return stats.hyperparameter_importance(self.valid, seed=self.seed, objective=self.objective)


@dataclass
class Report:
    source: str
    table: TrialTable
    models: dict[str, ModelReport]
    cross: pd.DataFrame
    value_of_search: pd.DataFrame
    key: dict
    z: float = stats.Z95
    notes: list[str] = field(default_factory=list)
    objective: stats.Objective = stats.ACCURACY

    @property
    def overall_best(self) -> dict | None:
        return None if self.cross.empty else self.cross.iloc[0].to_dict()


def front_objectives(objectives: tuple[stats.Objective, ...], valid: pd.DataFrame) -> tuple[stats.Objective, ...]:
    """The sweep's objectives when it searched several; else its metric against the measured decode speedup when
    its trials measured speed (the trade-off a user asks about); else none."""
    if len(objectives) > 1:
        return objectives
    speed = stats.Objective("decode_speedup", "max")
    if objectives[0] != speed and "decode_speedup" in valid and valid["decode_speedup"].notna().any():
        return (objectives[0], speed)
    return ()


def model_report(table: TrialTable, model: str, z: float = stats.Z95, seed: int = 0,
                 objective: stats.Objective | None = None, constraints: tuple[pareto.Constraint, ...] = ()
                 ) -> ModelReport:
    """Everything the report says about one model; `constraints`: also the best configuration meeting them all."""
    objective = objective or table.objective
    trials = table.trials[table.trials["model"] == model]
    valid = trials[trials["valid"]].copy()
    tasks = task_columns(valid.columns[valid.notna().any()]) if len(valid) else ()
    valid["acc_mean_stderr"] = stats.acc_mean_stderr(valid, tasks)
    best = stats.best_trial(valid, objective)
    metric = objective.metric
    heldout = stats.heldout_selection(valid, tasks) if metric == "acc_mean" else {
        "reason": f"the sweep ranks by {metric}; the held-out halves are of the zero-shot accuracies"}
    objectives = table.objectives
    objectives = objectives if objectives[0] == objective else (objective,)
    front_of = front_objectives(objectives, valid)
    try:
        constrained = pareto.best_under(valid, constraints, objective) if constraints else None
    except ValueError as error:
        raise ReportError(f"--constraint: {error}") from None
    lead = stats.lead_of_best(valid, tasks, z, objective, table.outcomes, table.ppl_windows)
    return ModelReport(
        model=model, trials=len(trials), valid=valid, invalid=trials.loc[~trials["valid"]], tasks=tasks,
        methods=stats.method_comparison(valid, objective),
        seq_len=stats.hyperparameter_impact(valid, "taylor_seq_len", objective),
        num_samples=stats.hyperparameter_impact(valid, "taylor_num_samples", objective),
        gradient=[stats.correlation(valid, g, metric) for g in GRAD_COLUMNS],
        extreme=stats.extreme_layers(valid, objective),
        # perplexity against accuracy either way round: the one the sweep did not rank by is the other's check
        ppl=stats.correlation(valid, "ppl", "acc_mean"),
        best=best, best_stderr=None if best is None else stats.plain(best["acc_mean_stderr"]),
        lead=lead, task_tests=stats.task_tests(lead, table.outcomes),
        paired=_paired_sections(valid, table, objective, z),
        seeds=stats.seed_spread(valid, objective), heldout=heldout,
        speed=stats.speed_quality(valid), objective=objective, front_objectives=front_of,
        front=pareto.pareto_front(valid, front_of, z, table.outcomes, table.ppl_windows) if front_of and len(valid)
        else None, constrained=constrained,
        recovery=stats.recovery_comparison(valid, objective, seed=seed), seed=seed,
    )


def _paired_sections(valid: pd.DataFrame, table, objective: stats.Objective, z: float) -> dict:
    """The method comparison and the hyperparameter impact, paired by configuration on the same items: each method
    against the best method, each value against the best value (acc_mean only: the items are accuracies)."""
    if objective.metric != "acc_mean" or not table.outcomes or valid.empty:
        return {}
    paired = {"method": stats.paired_levels(valid, "pruning_method", stats.method_comparison(valid)["best_method"],
                                            table.outcomes, z, labels=stats.method_labels(valid))}
    for column in ("taylor_seq_len", "taylor_num_samples"):
        paired[column] = stats.paired_levels(valid, column, stats.hyperparameter_impact(valid, column)["best_value"],
                                             table.outcomes, z)
    return {name: levels for name, levels in paired.items() if levels is not None}


def build_report(source, model: str | None = None, z: float = stats.Z95, seed: int = 0,
                 constraints: tuple[pareto.Constraint | str, ...] = ()) -> Report:
    """Everything the report says, from any input `load_trials` accepts; restricted to one model if given;
    `constraints` ("decode_speedup>=1.3" or pareto.Constraint): also each model's best configuration meeting them."""
    try:
        constraints = tuple(c if isinstance(c, pareto.Constraint) else pareto.parse_constraint(c) for c in constraints)
    except ValueError as error:
        raise ReportError(f"--constraint: {error}") from None
    table = load_trials(source)
    if model is not None:
        table = table.for_model(model)
    objective = table.objective
    models = {m: model_report(table, m, z, seed, objective, constraints) for m in table.models}
    valid = table.valid
    invalid_counts = table.invalid.groupby("model").size().to_dict() if len(table.invalid) else {}
    notes = list(table.notes)
    if table.superseded:
        notes.append(f"{table.superseded} folder(s) of trials that ran again after a resume were superseded "
                     "by the trial's later run and left out")
    unattributed = int(table.trials["model"].isna().sum())
    if unattributed:
        notes.append(f"{unattributed} trial(s) recorded no model and appear only in the invalid-trial count")
    return Report(
        source=table.source,
        table=table,
        models=models,
        cross=stats.cross_model(valid, invalid_counts, objective),
        value_of_search=stats.value_of_search(valid, objective),
        key=stats.key_figures(valid, table.tasks, len(table.trials)),
        z=z,
        notes=notes,
        objective=objective,
    )
