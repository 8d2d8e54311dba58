"""Which trial of a sweep to export: the report's best configuration for a model (by the objective the sweep
optimized), the K-th best, a named trial, or the best among those that meet constraints. Reads the sweep through
`reporting` (nothing pickled is read); imports neither torch nor ray."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from taylor_tune.errors import ConfigError, ReportError
from taylor_tune.reporting import consolidate, parse_constraint, read_experiment
from taylor_tune.reporting.stats import Objective, best_trial


class ExportError(ConfigError):
    """What was asked cannot be exported: no such trial, an unfinished one, no trial meeting the constraints, a
    rebuild that does not give the trial's numbers."""


@dataclass(frozen=True)
class Chosen:
    """The trial to export: its id and folder in the sweep's storage, its model, its reported row, the objective the
    sweep ranked by, and why it was chosen (said on the model card)."""

    trial_id: str
    folder: str
    model: str
    row: dict
    objective: Objective
    why: str


def choose(sweep: str, *, model: str | None = None, trial: str | None = None, rank: int | None = None,
           constraints: tuple[str, ...] = ()) -> Chosen:
    """The trial `taylor-tune export` rebuilds; ExportError (one line) when there is none to export."""
    if trial is not None and (rank is not None or constraints):
        raise ExportError("--trial names one trial; give it without --rank and --constraint")
    if rank is not None and rank < 1:
        raise ExportError(f"--rank {rank}: ranks start at 1 (the best)")
    try:
        table = consolidate(read_experiment(sweep), sweep)  # not load_trials: choosing reads no item outcomes
    except ReportError as error:
        raise ExportError(f"SWEEP: {error}") from None
    if model is None and trial is not None:  # a trial names its model
        named = table.trials.loc[table.trials["trial_id"].astype(str) == trial, "model"].dropna()
        model = str(named.iloc[0]) if len(named) else None
    if model is None:
        if len(table.models) != 1:
            raise ExportError(f"{sweep} holds {len(table.models)} models ({', '.join(table.models) or 'none'}); "
                              "name one with --model")
        model = table.models[0]
    try:
        table = table.for_model(model)
    except ReportError as error:
        raise ExportError(str(error)) from None
    objective, trials, valid = table.objective, table.trials, table.valid
    if trial is not None:
        found = trials[trials["trial_id"].astype(str) == trial]
        if found.empty:
            raise ExportError(f"--trial {trial!r}: no such trial of {model} in {sweep} (its trials: "
                              f"{', '.join(sorted(trials['trial_id'].astype(str))[:5])}"
                              f"{', ...' if len(trials) > 5 else ''})")
        row = found.iloc[0]
        if not row["valid"]:
            raise ExportError(f"--trial {trial}: not a finished trial ({row.get('reason') or 'no final result'}); "
                              "export a finished one")
        return _chosen(row, model, objective, f"trial {trial}, named")
    candidates, said = valid, f"the best by {objective.metric}"
    for text in constraints:
        try:
            constraint = parse_constraint(text)
        except ValueError as error:
            raise ExportError(f"--constraint: {error}") from None
        if constraint.metric not in valid:
            raise ExportError(f"--constraint {constraint}: {constraint.metric!r} is not a column of these trials")
        candidates = candidates[constraint.holds(candidates[constraint.metric]).to_numpy()]
    if constraints:
        said += " among the trials meeting " + ", ".join(constraints)
    if candidates.empty:
        raise ExportError(f"no finished trial of {model} in {sweep}"
                          + (f" meets {', '.join(constraints)}" if constraints else ""))
    for place in range(1, (rank or 1) + 1):  # the report's own ranking (stats.best_trial), taken in turn
        best = best_trial(candidates, objective)
        if best is None:
            raise ExportError(f"--rank {rank}: only {place - 1} finished trial(s) of {model} to rank")
        candidates = candidates[candidates["trial_id"] != best["trial_id"]]
    return _chosen(best, model, objective, said if (rank or 1) == 1 else f"rank {rank} by {objective.metric}"
                   + (" among the trials meeting " + ", ".join(constraints) if constraints else ""))


def _chosen(row: pd.Series, model: str, objective: Objective, why: str) -> Chosen:
    values = {k: v for k, v in row.items() if not (isinstance(v, float) and v != v)}
    return Chosen(str(row["trial_id"]), str(row["output_dir"]), model, values, objective, why)
