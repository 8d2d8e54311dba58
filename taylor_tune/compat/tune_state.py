"""The layout of a Ray 2.60 Tune experiment's saved state (`experiment_state-*.json`), read as JSON only: no Ray is
imported, so that `taylor-tune status` and the report (which must not load Ray) can read it.

Ray's `Trial` turns a saved RUNNING into PENDING when it loads (it loads to resume), so a live sweep's states
come from the saved state file itself, read through a pyarrow filesystem (local or cloud)."""

from __future__ import annotations

import json

from taylor_tune.compat import missing

TESTED = "2.60"
STATE_KEYS = ("trial_id", "status", "config")


def saved_trials(filesystem, root: str) -> tuple[list[dict], float | None]:
    """Every trial of the experiment's newest `experiment_state-*.json`, read as plain JSON: trial_id, status, config
    and last_result, and when the file was saved (epoch seconds; None if unknown). A newest file that does not
    parse gives way to the one before it.

    Nothing is unpickled: Ray stores some fields as cloudpickle blobs (`CLOUDPICKLE_FALLBACK`), and its own readers
    (`ExperimentAnalysis`, `Tuner.restore`) load them, running whatever code a planted blob names. Here such a value
    stays an opaque dict that is never read. Raises FileNotFoundError without a state file, ValueError for one that
    does not parse (a driver rewrites it every second, not atomically) or is not a Tune state at all (no list of
    trials: damaged, or another program's), CompatError for trials that lack a field Ray 2.60 writes (an upgrade)."""
    from pyarrow import fs

    infos = filesystem.get_file_info(fs.FileSelector(root, recursive=False))
    names = (i for i in infos if i.base_name.startswith("experiment_state-") and i.base_name.endswith(".json"))
    states = sorted(i.path for i in names)
    if not states:
        raise FileNotFoundError(f"no experiment_state-*.json in {root}")
    # named by the time each run started: the newest run's state sorts last; one that does not parse (half written
    # by a live driver, or damaged) gives way to the one before it
    for newest in reversed(states):
        try:
            with filesystem.open_input_stream(newest) as stream:
                saved = json.loads(stream.read().decode("utf-8"))
            break
        except (ValueError, UnicodeDecodeError) as error:
            if newest == states[0]:  # named: the error alone would not say which file
                raise ValueError(f"{newest.rsplit('/', 1)[-1]} does not parse ({error})") from None
    foreign = ValueError(f"{newest.rsplit('/', 1)[-1]} is not a Tune experiment state (no list of trials, each a "
                         "saved state and a runtime): damaged, or written by another program")
    if not isinstance(saved, dict) or not isinstance(saved.get("trial_data"), list):
        raise foreign
    trials = []
    for entry in saved["trial_data"]:
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(part, str) for part in entry)):
            raise foreign
        try:
            state, runtime = (json.loads(part) for part in entry)
        except ValueError:
            raise foreign from None
        if not (isinstance(state, dict) and isinstance(runtime, dict)):
            raise foreign
        gone = [f"trial state {key}" for key in STATE_KEYS if key not in state]
        missing("ray", TESTED, gone)
        trials.append({"trial_id": state["trial_id"], "status": state["status"], "config": state["config"],
                       "last_result": runtime.get("last_result") or {}})
    mtime = filesystem.get_file_info(newest).mtime
    return trials, None if mtime is None else mtime.timestamp()
