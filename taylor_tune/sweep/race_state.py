"""A racing sweep's saved state (`names.RACE_FILE`): written whole, read back and checked before a resumed race
decides anything with it. No Ray: the driver checks it before Ray starts, the resumed scheduler reads it.

Where it lives: Tune's restore copies every `.json` and `.pkl` at the top of the experiment folder into the driver's
staging folder and uploads that copy back over the folder as the sweep goes on, so a file of ours at the top would
be put back as it was at the restore. The race's state is in a folder of its own (`taylor_tune/`), which Tune
neither copies nor uploads; a sweep of an older version kept it at the top (`LEGACY_RACE_FILE`), read when the new
one is absent.

What is checked: its shape (every key a resumed scheduler reads, of the right type), and for each raced trial the
items the race compared (its outcomes file, or its perplexity windows) against the accuracies, or the perplexity, the
trial reported at that pass in its result.json: a file changed since does not decide a race (`RaceStateError`
names it)."""

from __future__ import annotations

import json
import math
import posixpath

import pandas as pd

from taylor_tune.jsonio import digest
from taylor_tune.schema import RACE_OBJECTIVES, task_key
from taylor_tune.storage.folder import race_file, read_outcomes, read_ppl_windows, read_reports, read_text
from taylor_tune.storage.names import PPL_WINDOWS_FILE, outcomes_file

# every field of a trial's entry that a resumed race reads, and its type
ENTRY_FIELDS = {"model": str, "block": int, "stage": str, "folder": str, "metrics": dict, "items": int,
                "final": bool, "stopped": bool, "why": str}
DECISION_FIELDS = {"trial": str, "block": int, "items": int, "go_on": bool}


class RaceStateError(ValueError):
    """The race's saved state, or a file it rests on, is not what the race recorded; the message names the file."""


def read_race(filesystem, root: str) -> dict | None:
    """The race's saved state, its shape checked (RaceStateError naming the file and the first wrong field); None
    when the sweep has none."""
    path = race_file(filesystem, root)
    if path is None:
        return None
    text = read_text(filesystem, path, root)
    try:
        saved = json.loads(text or "")
    except ValueError:
        raise RaceStateError(f"{path}: not JSON (cut short or damaged)") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("trials"), dict) \
            or not isinstance(saved.get("decisions"), dict) or saved.get("objective") not in RACE_OBJECTIVES:
        raise RaceStateError(f"{path}: not a race's state (trials, decisions and objective expected)")
    for trial_id, entry in saved["trials"].items():
        wrong = _wrong_field(entry, ENTRY_FIELDS)
        if wrong:
            raise RaceStateError(f"{path}: trial {trial_id}'s {wrong}")
    for model, decisions in saved["decisions"].items():
        for decision in decisions if isinstance(decisions, list) else [None]:
            wrong = _wrong_field(decision, DECISION_FIELDS)
            if wrong:
                raise RaceStateError(f"{path}: a decision of {model}: {wrong}")
    return saved


def _wrong_field(entry: object, fields: dict) -> str | None:
    if not isinstance(entry, dict):
        return "entry is not a mapping"
    for name, kind in fields.items():
        value = entry.get(name)
        if name not in entry:
            return f"{name} is missing"
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return f"{name} is {str(value)[:40]!r}, not {kind.__name__}"
    return None


def trial_folder(root: str, entry: dict) -> str:
    """The trial's folder under the experiment folder as it is now (the state records where it was when it ran)."""
    return posixpath.join(root, posixpath.basename(entry["folder"].rstrip("/")))


def reported_at(filesystem, folder: str, stage: str) -> dict | None:
    """The trial's report at `stage` (its result.json's last line of that stage), None when it has none."""
    _, reports, _ = read_reports(filesystem, folder)
    return next((r for r in reversed(reports) if isinstance(r, dict) and r.get("stage") == stage), None)


def item_scores(outcomes: pd.DataFrame, metrics: dict[str, str]) -> pd.Series:
    """Each item's score in its task's metric (acc or acc_norm), indexed by (task, doc_id): what a race compares."""
    return pd.concat([outcomes.xs(task, level="task", drop_level=False)[metric]
                      for task, metric in sorted(metrics.items())])


def items_digest(items: pd.Series | pd.DataFrame) -> str:
    """sha256 of what a race compared for a trial (index and values), recorded beside it in the race's state."""
    frame = items.to_frame() if isinstance(items, pd.Series) else items
    return digest([list(map(str, frame.index)), frame.to_numpy().tolist()])


def compared(filesystem, root: str, trial_id: str, entry: dict, objective: str) -> pd.Series | pd.DataFrame:
    """What the race compared for a trial (each item's score, or each window's NLL and tokens of the recorded
    pass), read from its folder and checked against the digest the race recorded of them and against what the trial
    reported at that pass (its result.json can lag the race's state by the second before a driver was killed: then
    the digest alone); RaceStateError naming the file otherwise."""
    folder = trial_folder(root, entry)
    report = reported_at(filesystem, folder, entry["stage"]) or {}
    if objective == "ppl":
        path = posixpath.join(folder, PPL_WINDOWS_FILE)
        items = read_ppl_windows(folder, filesystem)
        items = None if items is None else items.iloc[: entry["items"]]
        ppl = report.get("ppl")
        agrees = items is not None and len(items) == entry["items"] and (ppl is None or (
            isinstance(ppl, (int, float)) and math.isclose(
                math.exp(math.fsum(items["nll"]) / items["tokens"].sum()), ppl, rel_tol=1e-9)))
        said = f"the perplexity it reported at {entry['stage']}"
    else:
        path = posixpath.join(folder, outcomes_file(entry["stage"]))
        outcomes = read_outcomes(folder, entry["stage"], filesystem)
        try:
            items = None if outcomes is None else item_scores(outcomes, entry["metrics"])
        except (KeyError, TypeError):
            items = None
        agrees = items is not None and len(items) == entry["items"] and all(
            report.get(task_key(task)) is None or (isinstance(report[task_key(task)], (int, float)) and math.isclose(
                scores.mean(), report[task_key(task)], rel_tol=0, abs_tol=1e-12))
            for task, scores in items.groupby(level="task"))
        said = f"the accuracies it reported at {entry['stage']}"
    recorded = entry.get("sha256")
    if not agrees or (recorded is not None and recorded != items_digest(items)):
        which = said if not agrees else "the items the race recorded"
        raise RaceStateError(f"{path}: trial {trial_id}'s items do not give {which}; restore the file, or rerun the "
                             "sweep under another name")
    return items


def check_race(filesystem, root: str) -> dict | None:
    """The race's state and every file it rests on, checked (`read_race`, `compared`); None without a race."""
    saved = read_race(filesystem, root)
    for trial_id, entry in (saved or {}).get("trials", {}).items():
        compared(filesystem, root, trial_id, entry, saved["objective"])
    return saved
