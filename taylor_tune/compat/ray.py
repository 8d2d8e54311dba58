"""Ray 2.60's private names: the saved experiment state as `ExperimentAnalysis` found it.

Ray's `Trial` turns a saved RUNNING into PENDING when it loads (it loads to resume), so a live sweep's states
come from the saved state file itself, read through the analysis' own filesystem (local or cloud)."""

from __future__ import annotations

import json

from taylor_tune.compat import missing

TESTED = "2.60"
ANALYSIS_ATTRIBUTES = ("_fs", "_experiment_json_fs_path")


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
        import inspect

        from ray.tune import ExperimentAnalysis

        source = inspect.getsource(ExperimentAnalysis)
        gone = [n for n in ANALYSIS_ATTRIBUTES if f"self.{n} =" not in source]
    else:
        gone = [n for n in ANALYSIS_ATTRIBUTES if not hasattr(analysis, n)]
    missing("ray", TESTED, [f"ExperimentAnalysis.{n}" for n in gone])
