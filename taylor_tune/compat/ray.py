"""Ray 2.60's private and developer names: the saved experiment state as `ExperimentAnalysis` found it, and a
trial's own storage paths from inside its trainable.

Ray's `Trial` turns a saved RUNNING into PENDING when it loads (it loads to resume), so a live sweep's states
come from the saved state file itself, read through the analysis' own filesystem (local or cloud)."""

from __future__ import annotations

import inspect
import json

from ray.tune import ExperimentAnalysis

from taylor_tune.compat import missing

TESTED = "2.60"
ANALYSIS_ATTRIBUTES = ("_fs", "_experiment_json_fs_path")
STORAGE_ATTRIBUTES = ("trial_working_directory", "trial_fs_path")


def trial_storage(context):
    """The running trial's StorageContext (DeveloperAPI `TuneContext.get_storage`): its working directory and its
    folder in the sweep's storage; right in a reused worker too, where the process' cwd is an earlier trial's."""
    if not callable(getattr(context, "get_storage", None)):
        missing("ray", TESTED, ["TuneContext.get_storage"])
    storage = context.get_storage()
    missing("ray", TESTED, [f"StorageContext.{n}" for n in STORAGE_ATTRIBUTES if not hasattr(storage, n)])
    return storage


def saved_experiment_state(analysis) -> tuple[dict, float | None]:
    """The experiment state file as saved (JSON) and when it was saved (epoch seconds; None if unknown)."""
    check(analysis)
    with analysis._fs.open_input_stream(analysis._experiment_json_fs_path) as f:
        saved = json.loads(f.readall())
    mtime = analysis._fs.get_file_info(analysis._experiment_json_fs_path).mtime
    return saved, None if mtime is None else mtime.timestamp()


def check(analysis=None) -> None:
    """Raise CompatError if a fenced name is gone: on `analysis`, or (None) where ExperimentAnalysis sets it."""
    if analysis is None:
        source = inspect.getsource(ExperimentAnalysis)
        gone = [n for n in ANALYSIS_ATTRIBUTES if f"self.{n} =" not in source]
    else:
        gone = [n for n in ANALYSIS_ATTRIBUTES if not hasattr(analysis, n)]
    missing("ray", TESTED, [f"ExperimentAnalysis.{n}" for n in gone])
