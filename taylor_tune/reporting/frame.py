"""Tune results -> one tidy DataFrame, one row per trial (docs/specification.md §3), with every trial's validity and
reason.

An experiment folder (local, `file://` or any URI pyarrow understands, such as `s3://`) is read file by file,
so that a truncated result.json, an errored trial or one that never reported is counted, not fatal.
`ExperimentAnalysis` and `ResultGrid` are read through their experiment path, so a notebook and the CLI see
the same table. Must not import torch or ray.
"""

from __future__ import annotations

import json
import math
import posixpath
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from taylor_tune.compat import CompatError
from taylor_tune.compat.tune_state import saved_trials
from taylor_tune.errors import ReportError
from taylor_tune.jsonio import json_safe
from taylor_tune.reporting.stats import ACCURACY, Objective
from taylor_tune.schema import (
    CONFIG_COLUMNS,
    DIMENSIONS,
    SPEED_METRICS,
    is_recovery_stage,
    task_columns,
    task_key,
    zero_shot_stage,
)
from taylor_tune.storage.folder import (
    experiment_entries,
    race_file,
    read_outcomes,
    read_ppl_windows,
    read_reports,
    read_text,
    trial_dirs,
    trial_id_of,
)
from taylor_tune.storage.location import as_given
from taylor_tune.storage.names import EXPERIMENT_RECORD, PPL_WINDOWS_FILE, outcomes_file

GRAD_COLUMNS = ("grad_mean_ratio", "grad_norm_ratio", "grad_mean_range", "grad_norm_range")
SPEC_COLUMNS = ("output_dir", "ppl", "acc_mean", "params_count", "pruning_ratio", *GRAD_COLUMNS,
                "extreme_pruning_layers", "pruning_method", "taylor_seq_len", "taylor_num_samples")
ARTIFACTS = ("config.json", "evaluation.json", "pruning_summary.json", "layer_analysis.json")


@dataclass
class TrialTable:
    """Every trial of an experiment: `trials` has one row per trial with `valid` and `reason` columns."""

    trials: pd.DataFrame
    source: str
    filesystem: object = None  # the pyarrow filesystem `output_dir` paths belong to, when not a local path or URI
    superseded: int = 0  # folders of trials that ran again after a resume, left out (see _drop_superseded)
    # trial_id -> each item's score in acc_mean's sense (`scored_items`), for the valid trials whose last pass kept
    # its outcomes: what paired comparisons read (empty for a DataFrame source)
    outcomes: dict = field(default_factory=dict)
    # trial_id -> its perplexity windows (`read_ppl_windows`), for the valid trials that kept them and whose windows
    # give their reported ppl: what the paired perplexity comparison reads
    ppl_windows: dict = field(default_factory=dict)
    # one line per file that a valid trial kept and that contradicts what it reported (its items, its windows): the
    # file is not read for the paired comparisons, and the report says so
    notes: list = field(default_factory=list)

    @property
    def valid(self) -> pd.DataFrame:
        return self.trials[self.trials["valid"]]

    @property
    def invalid(self) -> pd.DataFrame:
        cols = [c for c in ("trial_id", *CONFIG_COLUMNS, "reason") if c in self.trials]
        return self.trials.loc[~self.trials["valid"], cols]

    @property
    def models(self) -> list[str]:
        return sorted(self.trials["model"].dropna().unique().tolist()) if "model" in self.trials else []

    @property
    def tasks(self) -> tuple[str, ...]:
        return task_columns(self.valid.columns[self.valid.notna().any()]) if len(self.valid) else ()

    @property
    def objective(self) -> Objective:
        """What the sweep optimized, as its trials' configs recorded it (acc_mean / max for older sweeps)."""
        if "objective_metric" not in self.trials:
            return ACCURACY
        pairs = self.trials[["objective_metric", "objective_mode"]].dropna().drop_duplicates()
        if len(pairs) > 1:
            found = ", ".join(f"{m} ({d})" for m, d in pairs.itertuples(index=False))
            raise ReportError(
                f"{self.source}: the trials optimized different metrics ({found}); report one sweep at a time"
            )
        return Objective(*pairs.iloc[0]) if len(pairs) else ACCURACY

    @property
    def objectives(self) -> tuple[Objective, ...]:
        """Every objective of the search, the primary (`objective`) first; one unless it searched several."""
        if "objectives" not in self.trials:
            return (self.objective,)
        found = self.trials["objectives"].dropna().unique()
        if len(found) > 1:
            raise ReportError(f"{self.source}: the trials searched different objectives ({'; '.join(found)}); "
                              "report one sweep at a time")
        if not len(found):
            return (self.objective,)
        return tuple(Objective(*item.split(":")) for item in found[0].split(","))

    def for_model(self, model: str) -> TrialTable:
        if model not in self.models:
            raise ReportError(f"--model {model!r}: not in the experiment; models: {', '.join(self.models) or 'none'}")
        trials = self.trials[self.trials["model"] == model].reset_index(drop=True)
        ids = set(trials["trial_id"].astype(str))
        return TrialTable(trials, self.source, self.filesystem, self.superseded,
                          notes=[n for n in self.notes if n.split(":")[0].removeprefix("trial ") in ids])


# ---------------------------------------------------------------- reading a folder


def _last_failure(error_text: str) -> str:
    """The last line of the last failure in Tune's error.txt: the exception and its message."""
    block = error_text.rsplit("Failure # ", 1)[-1]
    lines = [line.strip() for line in block.splitlines() if line.strip()]
    return lines[-1] if lines else "unknown error"


def _final_fidelity(config: dict) -> int | None:
    """The item limit of a trial's last evaluation (0 = every item); None where the config does not say."""
    fidelities = (((config or {}).get("fixed") or {}).get("evaluation") or {}).get("fidelities")
    if not fidelities:
        return None
    return fidelities[-1] or 0


def read_trial(filesystem, trial_dir: str) -> dict:
    """One trial folder -> one row: its last reported metrics plus trial_id, trial_dir, error and read_error."""
    row: dict = {"trial_id": trial_id_of(posixpath.basename(trial_dir.rstrip("/"))), "trial_dir": trial_dir}
    text, reports, broken = read_reports(filesystem, trial_dir)
    params = read_text(filesystem, posixpath.join(trial_dir, "params.json"))
    try:
        config = json.loads(params) if params else {}
    except json.JSONDecodeError:
        config = {}
    if reports:
        last = reports[-1]
        config = config or last.get("config") or {}
        row |= {k: v for k, v in last.items() if k != "config"}
        row["run_dir"] = last.get("output_dir")
    else:
        row["read_error"] = "result.json is missing" if text is None else (
            "result.json has no readable report" if broken else "no results reported (result.json is empty)")
    for key in CONFIG_COLUMNS:  # a trial that never reported still says which configuration it was
        if row.get(key) is None and key in config:
            row[key] = config[key]
    row["final_fidelity"] = _final_fidelity(config)
    objective = ((config or {}).get("fixed") or {}).get("objective") or {}
    if objective:
        row["objective_metric"], row["objective_mode"] = objective.get("metric"), objective.get("mode")
    objectives = ((config or {}).get("fixed") or {}).get("objectives") or []
    if len(objectives) > 1:  # a multi-objective search: `metric:mode` of each, the primary first
        row["objectives"] = ",".join(f"{o.get('metric')}:{o.get('mode')}" for o in objectives)
    error = read_text(filesystem, posixpath.join(trial_dir, "error.txt"))
    if error:
        row["error"] = _last_failure(error)
    if reports and params:
        disagrees = disagreement(filesystem, trial_dir, reports[-1], config)
        if disagrees:
            row["disagrees"] = disagrees
    row["output_dir"] = trial_dir  # where the artifacts live now; the path during the run is kept as run_dir
    return row


def same_value(a, b) -> bool:
    """Two values as the trial wrote them to two files (NaN as null, ±inf as "inf", as `jsonio.json_safe` writes
    them), equal: numbers to the last bit but for a float's JSON spelling, everything else exactly."""
    a, b = json_safe(a), json_safe(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) | isinstance(b, bool):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


def disagreement(filesystem, trial_dir: str, last: dict, params: dict) -> str | None:
    """Where a finished trial's own files contradict each other, in one line naming them; None when they agree (or
    the trial has not written the file to compare with). Its last report (result.json) against the final metrics it
    wrote beside it (evaluation.json): every key both hold. What Tune ran (params.json) against the trial's record of
    its configuration (config.json): the model, the seed, each searched and fixed pruning setting, the item limits
    of the zero-shot passes. Either file may be the edited one: both are named."""
    text = read_text(filesystem, posixpath.join(trial_dir, "evaluation.json"))
    try:
        final = json.loads(text) if text else None
    except ValueError:
        return "evaluation.json is not JSON (cut short or damaged)"
    if final is not None:
        if not isinstance(final, dict):
            return "evaluation.json is not the trial's final metrics"
        if last.get("stage") == final.get("stage"):
            differ = sorted(k for k in final.keys() & last.keys() if not same_value(final[k], last[k]))
            if differ:
                return f"result.json and evaluation.json disagree on {', '.join(differ[:3])}"
    text = read_text(filesystem, posixpath.join(trial_dir, "config.json"))
    try:
        record = json.loads(text) if text else None
    except ValueError:
        return "config.json is not JSON (cut short or damaged)"
    if record is None:
        return None
    prune = record.get("prune") if isinstance(record, dict) else None
    fixed = params.get("fixed") if isinstance(params.get("fixed"), dict) else {}
    if not isinstance(prune, dict):
        return "config.json is not a trial's configuration"
    ran = {DIMENSIONS.get(k, k): v for k, v in params.items() if k in DIMENSIONS or k in ("model", "seed")}
    ran |= fixed.get("prune") if isinstance(fixed.get("prune"), dict) else {}
    differ = sorted(f"prune.{k}" for k, v in ran.items() if not same_value(prune.get(k), v))
    evaluation = (record.get("evaluation") or {}) if isinstance(record.get("evaluation"), dict) else {}
    passes = (fixed.get("evaluation") or {}) if isinstance(fixed.get("evaluation"), dict) else {}
    differ += [f"evaluation.{k}" for k in ("fidelities", "tasks") if not same_value(evaluation.get(k), passes.get(k))]
    if differ:
        return f"params.json and config.json disagree on {', '.join(differ[:3])}"
    return None


def read_experiment(location: str, filesystem=None) -> pd.DataFrame:
    """Every trial folder of a Tune experiment -> raw rows (not yet judged valid)."""
    given = filesystem
    filesystem, root, entries = experiment_entries(str(location), filesystem)
    found = trial_dirs(filesystem, entries)
    if not found and not any(e.base_name.startswith("experiment_state-") for e in entries):
        raise ReportError(f"{location}: not a Tune experiment folder (no trial folders, no experiment_state-*.json)")
    if not found:  # a sweep that has started and has no trial yet, or a state that is not Tune's at all
        try:
            saved_trials(filesystem, root)
        except (ValueError, UnicodeDecodeError, CompatError) as error:
            raise ReportError(f"{location}: not a readable Tune experiment ({error})") from None
    rows = pd.DataFrame([read_trial(filesystem, d) for d in found])
    _check_objective(rows, read_text(filesystem, posixpath.join(root, EXPERIMENT_RECORD)))
    raced = _race_lines(filesystem, root)
    if raced and len(rows):
        rows["race"] = [raced.get(trial_id) for trial_id in rows["trial_id"]]
    if given is None and len(rows):  # named as the user names the sweep: s3://bucket/..., not bucket/...
        rows["output_dir"] = [as_given(location, d) for d in rows["output_dir"]]
    return rows


def _check_objective(rows: pd.DataFrame, record_text: str | None) -> None:
    """Each trial's objective (its params.json) against the one the sweep started with (the experiment record):
    a trial that names another is flagged (`disagrees`), not ranked by it."""
    try:
        record = json.loads(record_text) if record_text else None
    except ValueError:
        record = None
    if not isinstance(record, dict) or "objective_metric" not in rows or not len(rows):
        return
    metric, mode = record.get("metric"), record.get("mode")
    for i, row in rows.iterrows():
        if isinstance(row.get("disagrees"), str) or not isinstance(row.get("objective_metric"), str):
            continue
        if (row["objective_metric"], row.get("objective_mode")) != (metric, mode):
            rows.loc[i, "disagrees"] = (f"params.json and {EXPERIMENT_RECORD} disagree on the objective "
                                        f"({row['objective_metric']} {row.get('objective_mode')}, {metric} {mode})")


def _race_lines(filesystem, root: str) -> dict[str, str]:
    """A racing sweep's word on each trial it stopped (the race's state, the scheduler's: trial id -> why), {}
    otherwise. An older version kept the state at the top of the folder (LEGACY_RACE_FILE)."""
    path = race_file(filesystem, root)
    text = None if path is None else read_text(filesystem, path, root)
    try:
        trials = json.loads(text).get("trials", {}) if text else {}
    except (ValueError, AttributeError):
        return {}
    return {trial_id: entry["why"] for trial_id, entry in trials.items()
            if isinstance(entry, dict) and entry.get("stopped") is True and isinstance(entry.get("why"), str)}


# ---------------------------------------------------------------- deciding validity


def _finite(value) -> bool:
    try:
        return value is not None and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _reason(row: pd.Series, tasks: tuple[str, ...]) -> str | None:
    """Why a trial cannot enter the statistics (None: it can)."""
    error = row.get("error") if isinstance(row.get("error"), str) else None
    if isinstance(row.get("read_error"), str):
        return f"errored: {error}" if error else row["read_error"]
    if isinstance(row.get("disagrees"), str):  # its numbers contradict each other: none of them is used
        return f"its files disagree: {row['disagrees']}"
    if not _finite(row.get("acc_mean")):
        if error:
            return f"errored: {error}"
        stage = row.get("stage")
        if is_recovery_stage(stage):  # ASHA's recovery rungs: stopped before the evaluation
            return f"incomplete: stopped during recovery, before the evaluation (last stage {stage!r})"
        raced = row.get("race") if isinstance(row.get("race"), str) else None
        if raced and isinstance(stage, str) and stage.startswith("ppl") and _finite(row.get("ppl_windows")):
            # a race on ppl: stopped after a perplexity pass, before the zero-shot passes
            return f"incomplete: perplexity on {int(row['ppl_windows'])} windows, not every window ({raced})"
        return (
            f"incomplete: no finite acc_mean (last stage {stage!r})" if isinstance(stage, str) else "no finite acc_mean"
        )
    metric = row.get("objective_metric")
    # an infinite perplexity is a result (the worst one), a missing one is not
    if (
        isinstance(metric, str)
        and metric != "acc_mean"
        and not (_finite(row.get(metric)) or str(row.get(metric)) in ("inf", "Infinity"))
    ):
        return f"errored: {error}" if error else f"no {metric}, the sweep's metric"
    expected, reached = row.get("final_fidelity"), row.get("fidelity")
    if _finite(expected) and _finite(reached) and int(reached) != int(expected):
        raced = row.get("race") if isinstance(row.get("race"), str) else None
        why = f"errored: {error}" if error else raced or "stopped early by the scheduler"
        return f"incomplete: evaluated on {int(reached)} items per task, not the full {int(expected) or 'set'} ({why})"
    for task in tasks:
        if not _finite(row.get(task_key(task))):
            return f"{task_key(task)} is missing or not finite"
    return None


def _drop_superseded(rows: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """A trial that started just before its driver was killed, before the saved state knew of it, runs again
    after the resume in a second folder with the same trial id: keep one row per trial id, a valid one first."""
    if "trial_id" not in rows or not rows["trial_id"].duplicated().any():
        return rows, 0
    order = rows.assign(
        _valid=rows["valid"].astype(int), _dir=rows.get("output_dir", pd.Series("", index=rows.index)).astype(str)
    )
    keep = (
        order.sort_values(["_valid", "_dir"], ascending=[False, False], kind="stable").drop_duplicates("trial_id").index
    )
    return rows.loc[sorted(keep)].reset_index(drop=True), len(order) - len(keep)


def consolidate(rows: pd.DataFrame, source: str = "DataFrame") -> TrialTable:
    """Judge each trial: valid trials have a finite acc_mean from their final evaluation and every task of their
    model."""
    rows = rows.copy().reset_index(drop=True)
    if "model" not in rows:
        rows["model"] = pd.Series([None] * len(rows), dtype=object)
    for column in (*SPEC_COLUMNS, *CONFIG_COLUMNS[1:]):
        if column not in rows:
            rows[column] = float("nan")
    reasons = []
    for _, group in rows.groupby("model", dropna=False, sort=False):
        tasks = task_columns(group.columns[group.notna().any()])
        reasons.extend((i, _reason(row, tasks)) for i, row in group.iterrows())
    reason = pd.Series(dict(reasons), dtype=object).reindex(rows.index)
    no_model = rows["model"].isna()
    reason[no_model] = reason[no_model].fillna("no model recorded")
    rows["reason"] = reason
    rows["valid"] = rows["reason"].isna()
    rows, superseded = _drop_superseded(rows)
    for task in task_columns(rows.columns):  # an accuracy and its stderr must be numbers, not "None" strings
        for column in (task_key(task), task_key(task, "_stderr")):
            if column in rows:
                rows[column] = pd.to_numeric(rows[column], errors="coerce")
    for column in ("acc_mean", "ppl", *GRAD_COLUMNS, "extreme_pruning_layers", "params_count", "pruning_ratio",
                   *SPEED_METRICS):
        if column in rows:
            rows[column] = pd.to_numeric(rows[column], errors="coerce")
    if "trial_id" not in rows:
        rows["trial_id"] = [f"row{i}" for i in range(len(rows))]
    return TrialTable(rows, source, superseded=superseded)


def scored_items(outcomes: pd.DataFrame, row: pd.Series) -> pd.Series | None:
    """Each item's score in the sense of the trial's acc_<task> (per task the column, acc or acc_norm, whose mean is
    the reported score), indexed by (task, doc_id); None when a task's outcomes do not reproduce its score."""
    parts = []
    for task, items in outcomes.groupby(level="task", sort=True):
        reported, count = row.get(task_key(task)), row.get(task_key(task, "_n"))
        if isinstance(count, (int, float)) and count == count and (len(items) != count
                                                                    or items.index.duplicated().any()):
            return None  # not the items the trial scored (some missing, or one twice)
        column = next((c for c in ("acc", "acc_norm") if items[c].notna().all() and reported is not None
                       and math.isclose(items[c].mean(), reported, rel_tol=0, abs_tol=1e-12)), None)
        if column is None:
            return None
        parts.append(items[column])
    return pd.concat(parts) if parts else None


def attach_outcomes(table: TrialTable) -> TrialTable:
    """Each valid trial's items of its last zero-shot pass (`read_outcomes`, scored by `scored_items`), and its
    perplexity windows where they give its reported ppl."""
    for _, row in table.valid.iterrows():
        # the folder as it is now (where the report was pointed), never the path the trial ran in: a copy of a sweep
        # is read as the copy, and a sweep whose original is gone still finds its items
        folder = row.get("output_dir") if isinstance(row.get("output_dir"), str) else row.get("trial_dir")
        windows = read_ppl_windows(folder, table.filesystem) if isinstance(folder, str) else None
        ppl = row.get("ppl")
        if windows is not None and len(windows) and isinstance(ppl, float) and _gives_ppl(windows, ppl):
            table.ppl_windows[row["trial_id"]] = windows
        elif windows is not None and isinstance(ppl, float):
            table.notes.append(f"trial {row['trial_id']}: its {PPL_WINDOWS_FILE} does not give the perplexity it "
                               "reported; left out of the paired perplexity comparisons")
        fidelity = row.get("final_fidelity")
        if not isinstance(folder, str) or fidelity is None or fidelity != fidelity:
            continue
        stage = zero_shot_stage(int(fidelity) or None)
        outcomes = read_outcomes(folder, stage, table.filesystem)
        scored = None if outcomes is None else scored_items(outcomes, row)
        if scored is not None:
            table.outcomes[row["trial_id"]] = scored
        elif outcomes is not None:
            table.notes.append(f"trial {row['trial_id']}: its {outcomes_file(stage)} does not give the accuracies it "
                               "reported; left out of the paired comparisons")
    return table


def _gives_ppl(windows: pd.DataFrame, ppl: float) -> bool:
    try:
        return math.isclose(math.exp(math.fsum(windows["nll"]) / windows["tokens"].sum()), ppl, rel_tol=1e-9)
    except (OverflowError, ZeroDivisionError, TypeError, ValueError):
        return False


def load_trials(source) -> TrialTable:
    """An experiment path or URI, an ExperimentAnalysis, a ResultGrid, a DataFrame or a TrialTable -> TrialTable."""
    if isinstance(source, TrialTable):
        return source
    if isinstance(source, pd.DataFrame):
        return consolidate(source)
    if isinstance(source, (str, Path)):
        return attach_outcomes(consolidate(read_experiment(str(source)), str(source)))
    path = getattr(source, "experiment_path", None)  # ExperimentAnalysis and ResultGrid both carry it
    if path is not None:
        filesystem = getattr(source, "filesystem", None)
        table = consolidate(read_experiment(str(path), filesystem), str(path))
        table.filesystem = filesystem
        return attach_outcomes(table)
    raise ReportError(
        f"cannot read results from a {type(source).__name__}; give a path, ExperimentAnalysis, ResultGrid or DataFrame"
    )
