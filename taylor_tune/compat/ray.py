"""Ray 2.60's private and developer names: a trial's own storage paths from inside its trainable, and a local Ray
whose services listen on loopback only. The saved experiment state's layout is `tune_state` (it needs no Ray)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from taylor_tune.compat import missing
from taylor_tune.compat.tune_state import TESTED

STORAGE_ATTRIBUTES = ("trial_working_directory", "trial_fs_path", "storage_filesystem")


def trial_storage(context):
    """The running trial's StorageContext (DeveloperAPI `TuneContext.get_storage`): its working directory and its
    folder in the sweep's storage; right in a reused worker too, where the process' cwd is an earlier trial's."""
    if not callable(getattr(context, "get_storage", None)):
        missing("ray", TESTED, ["TuneContext.get_storage"])
    storage = context.get_storage()
    missing("ray", TESTED, [f"StorageContext.{n}" for n in STORAGE_ATTRIBUTES if not hasattr(storage, n)])
    return storage


# Ray lowers every worker process's priority (nice 15; the driver stays at 0). A trial is the sweep's main work, not
# background work: at 15, any CPU-bound process on the machine starves the trials (beside two busy loops on 2 cores a
# niced trial got under 2% of a core, 30 s of CPU in 29 minutes; BENCHMARKS.md). A local sweep's
# trials run at the priority of the user who started it.
WORKER_NICENESS = 0


def init_local(**kwargs) -> None:
    """`ray.init(address="local", **kwargs)` with every process it starts listening on 127.0.0.1 only.

    Ray 2.60 binds its gRPC servers (GCS, raylet, each worker) and its agents to the node's address, but
    `ray.init` turns a node address of 127.0.0.1 into the machine's reachable one (`resolve_ip_for_localhost`,
    so that other nodes could join) and then listens on every interface, the gRPC servers on `::`. A local sweep
    has no other node: the address is kept at 127.0.0.1 for the call (the started processes get it as
    `--node-ip-address`). Its workers run at WORKER_NICENESS."""
    import ray

    with on_loopback():
        ray.init(address="local", _node_ip_address="127.0.0.1", _system_config={"worker_niceness": WORKER_NICENESS},
                 **kwargs)


@contextmanager
def on_loopback() -> Iterator[None]:
    """Inside, Ray keeps a node address of 127.0.0.1 as it is (see `init_local`): nodes started here listen on
    loopback only (also a `ray.cluster_utils.Cluster`'s, for tests)."""
    from ray._private import services

    resolve = services.resolve_ip_for_localhost
    services.resolve_ip_for_localhost = lambda host: host
    try:
        yield
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
