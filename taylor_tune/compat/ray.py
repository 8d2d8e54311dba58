"""Ray 2.60's private and developer names: the layout of the saved experiment state, read as JSON only, a
trial's own storage paths from inside its trainable, and a local Ray whose services listen on loopback only.

Ray's `Trial` turns a saved RUNNING into PENDING when it loads (it loads to resume), so a live sweep's states
come from the saved state file itself, read through a pyarrow filesystem (local or cloud)."""

from __future__ import annotations

import json

from taylor_tune.compat import missing

TESTED = "2.60"
STATE_KEYS = ("trial_id", "status", "config")
STORAGE_ATTRIBUTES = ("trial_working_directory", "trial_fs_path", "storage_filesystem")


def trial_storage(context):
    """The running trial's StorageContext (DeveloperAPI `TuneContext.get_storage`): its working directory and its
    folder in the sweep's storage; right in a reused worker too, where the process' cwd is an earlier trial's."""
    if not callable(getattr(context, "get_storage", None)):
        missing("ray", TESTED, ["TuneContext.get_storage"])
    storage = context.get_storage()
    missing("ray", TESTED, [f"StorageContext.{n}" for n in STORAGE_ATTRIBUTES if not hasattr(storage, n)])
    return storage


def saved_trials(filesystem, root: str) -> tuple[list[dict], float | None]:
    """Every trial of the experiment's newest `experiment_state-*.json`, read as plain JSON: trial_id, status, config
    and last_result, and when the file was saved (epoch seconds; None if unknown). A newest file that does not
    parse gives way to the one before it.

    Nothing is unpickled: Ray stores some fields as cloudpickle blobs (`CLOUDPICKLE_FALLBACK`), and its own readers
    (`ExperimentAnalysis`, `Tuner.restore`) load them, running whatever code a planted blob names. Here such a value
    stays an opaque dict that is never read. Raises FileNotFoundError without a state file, ValueError for one that
    does not parse (a driver rewrites it every second, not atomically), CompatError for one of another layout."""
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
        except (ValueError, UnicodeDecodeError):
            if newest == states[0]:
                raise
    if not isinstance(saved, dict) or not isinstance(saved.get("trial_data"), list):
        missing("ray", TESTED, ["experiment_state.trial_data"])
    trials = []
    for entry in saved["trial_data"]:
        state, runtime = (json.loads(part) for part in entry)
        gone = [f"trial state {key}" for key in STATE_KEYS if key not in state]
        missing("ray", TESTED, gone)
        trials.append({"trial_id": state["trial_id"], "status": state["status"], "config": state["config"],
                       "last_result": runtime.get("last_result") or {}})
    mtime = filesystem.get_file_info(newest).mtime
    return trials, None if mtime is None else mtime.timestamp()


def init_local(**kwargs) -> None:
    """`ray.init(address="local", **kwargs)` with every process it starts listening on 127.0.0.1 only.

    Ray 2.60 binds its gRPC servers (GCS, raylet, each worker) and its agents to the node's address, but
    `ray.init` turns a node address of 127.0.0.1 into the machine's reachable one (`resolve_ip_for_localhost`,
    so that other nodes could join) and then listens on every interface, the gRPC servers on `::`. A local sweep
    has no other node: the address is kept at 127.0.0.1 for the call (the started processes get it as
    `--node-ip-address`)."""
    import ray
    from ray._private import services

    resolve = services.resolve_ip_for_localhost
    services.resolve_ip_for_localhost = lambda host: host
    try:
        ray.init(address="local", _node_ip_address="127.0.0.1", **kwargs)
    finally:
        services.resolve_ip_for_localhost = resolve


def check() -> None:
    """Raise CompatError if a fenced name is gone (the state file's layout is checked as it is read)."""
    from ray._private import services
    from ray.tune import TuneContext

    gone = [] if callable(getattr(TuneContext, "get_storage", None)) else ["TuneContext.get_storage"]
    if not callable(getattr(services, "resolve_ip_for_localhost", None)):
        gone.append("ray._private.services.resolve_ip_for_localhost")
    missing("ray", TESTED, gone)
