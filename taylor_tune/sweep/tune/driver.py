"""Start or resume a sweep (idempotent). Its status is read by `sweep.status`, without Ray.

`run_sweep` restores the experiment when its folder holds one (`Tuner.can_restore`, then `Tuner.restore`
with `resume_errored=True`), else starts it. Finished trials are never run again. SIGTERM (what `ray job
stop` sends) becomes Tune's graceful SIGINT stop, and the experiment state is saved every second
(TUNE_GLOBAL_CHECKPOINT_S=1), so even a SIGKILLed driver loses no finished trial. Locally Ray starts with
`ray.init(address="local")`, every service on 127.0.0.1 (`compat.ray.init_local`); under `ray job submit`
(RAY_ADDRESS set) the driver joins the cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable

import ray
from ray import tune

from taylor_tune.compat.ray import init_local, on_loopback
from taylor_tune.errors import ConfigError
from taylor_tune.schema import zero_shot_stage
from taylor_tune.storage.folder import check_resumable, experiment_folder, has_state, set_aside_damaged_state
from taylor_tune.storage.location import check_storage, joined
from taylor_tune.storage.lock import driver_lock
from taylor_tune.sweep.experiment import Experiment, check_models, check_sources
from taylor_tune.sweep.folder import check_race_state, check_unchanged
from taylor_tune.sweep.tune.console import ConsoleCallback, FullStorage, quiet_when_full
from taylor_tune.sweep.tune.leases import start_leases
from taylor_tune.sweep.tune.metrics import SweepMetricsCallback
from taylor_tune.sweep.tune.reports import KeptReports
from taylor_tune.sweep.tune.scheduler import FidelityASHA, RaceScheduler
from taylor_tune.sweep.tune.search import PerModelSearcher, domains_of
from taylor_tune.sweep.tune.space import fixed_settings, param_space


def experiment_path(experiment: Experiment) -> str:
    """The experiment's folder, `<storage_path>/<name>`, as its guards, its lock and Tune name it."""
    return experiment_folder(experiment.storage_path, experiment.name)


def validate(experiment: Experiment) -> None:
    """Every check that needs no Ray: storage, models, every point's plan and calibration draw, and resources that
    this machine cannot give (local runs)."""
    check_storage(experiment.storage_path)
    folder = experiment_path(experiment)
    check_resumable(folder)
    check_race_state(folder)
    # torch and transformers (seconds of CPU to import) only once the storage and the folder take the sweep, so that
    # a refused storage is said at once
    import torch

    from taylor_tune.sweep.preflight import (  # torch and transformers too (above)
        check_calibration_sizes,
        check_memory,
        check_plans,
        check_recovery,
        check_streaming,
        memory_bytes,
    )

    check_sources(experiment)
    check_models(experiment)
    check_plans(experiment)
    check_calibration_sizes(experiment)
    check_recovery(experiment)
    check_streaming(experiment)
    check_memory(experiment)
    gpu = experiment.resources.gpu
    local = not os.environ.get("RAY_ADDRESS")
    if local and experiment.resources.cpu > (os.cpu_count() or 1):
        raise ConfigError(f"resources.cpu: {experiment.resources.cpu:g} CPUs per trial requested, but this machine has "
                          f"{os.cpu_count()}; no trial could start")
    reserved = experiment.resources.memory
    if local and reserved is not None and reserved * 2**30 > memory_bytes():
        raise ConfigError(f"resources.memory: {reserved:g} GiB per trial requested, but this machine has "
                          f"{memory_bytes() / 2**30:.1f} GiB; no trial could start")
    if gpu != "auto" and gpu > 0 and local:
        if not torch.cuda.is_available():
            raise ConfigError(
                f"resources.gpu: {gpu} GPU per trial requested, but this machine has no GPU; use auto or 0"
            )


def cache_folder(path: str) -> str:
    """The sweep's importance cache, in its storage (a folder or a URI); requests and paired speed beside it."""
    return f"{path}/importance_cache"


def _start_ray(verbose: bool = False) -> None:
    """Ray started or joined. `ray.init` sets a SIGTERM handler of its own (`sys.exit(15)`): the one before it (the
    CLI's, an interrupt that exits 4) is put back, so that a SIGTERM between Ray's start and Tune's is still an
    interrupt (seen in CI: exit 15)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        _init_ray(verbose)
    finally:
        if callable(previous) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


def _init_ray(verbose: bool) -> None:
    level = logging.INFO if verbose else logging.WARNING
    address = os.environ.get("RAY_ADDRESS")
    if address:
        # a head on loopback (`ray start --node-ip-address=127.0.0.1`, a test's Cluster) listens there only: joined
        # there, not at the machine's address that ray.init would turn 127.0.0.1 into
        loopback = address.split("://")[-1].rsplit(":", 1)[0] in ("127.0.0.1", "localhost")
        with on_loopback() if loopback else contextlib.nullcontext():
            ray.init(address="auto", log_to_driver=False, logging_level=level)
    else:
        init_local(include_dashboard=False, log_to_driver=False, logging_level=level)


def _resources(experiment: Experiment) -> dict:
    cluster = ray.cluster_resources()
    cluster_gpus, cluster_cpus = cluster.get("GPU", 0), cluster.get("CPU", 0)
    gpu = experiment.resources.gpu
    if gpu == "auto":
        gpu = 1 if cluster_gpus > 0 else 0
    elif gpu > 0 and cluster_gpus == 0:
        raise ConfigError(f"resources.gpu: {gpu} GPU per trial requested, but the cluster has none; use auto or 0")
    if experiment.resources.cpu > cluster_cpus:
        raise ConfigError(f"resources.cpu: {experiment.resources.cpu:g} CPUs per trial requested, but the cluster has "
                          f"{cluster_cpus:g}; no trial could start")
    if experiment.resources.memory is None:
        return {"cpu": experiment.resources.cpu, "gpu": gpu}
    reserved = int(experiment.resources.memory * 2**30)
    largest = max((node["Resources"].get("memory", 0) for node in ray.nodes() if node["Alive"]), default=0)
    if reserved > largest:  # Ray's memory of a node: its memory less its object store
        raise ConfigError(f"resources.memory: {experiment.resources.memory:g} GiB per trial requested, but the "
                          f"largest node offers Ray {largest / 2**30:.1f} GiB; no trial could start")
    return {"cpu": experiment.resources.cpu, "gpu": gpu, "memory": reserved}


def run_sweep(experiment: Experiment, *, verbose: bool = False, interrupted: Callable[[], bool] | None = None):
    """Run (or resume) the sweep to completion; returns Tune's ResultGrid. The console gets one line per trial
    that ends and a status line at most every 30 s; `verbose` adds Tune's own tables. One driver per experiment
    folder: a second one is refused before Ray starts (`lock.driver_lock`). `interrupted` (the CLI's): whether an
    interrupt came during the start that the code it hit swallowed (an extension module's initialisation prints it
    as "Exception ignored" and goes on); asked just before Tune takes over, which then stops instead of running."""
    validate(experiment)
    folder = experiment_path(experiment)
    with driver_lock(folder):
        check_unchanged(experiment, folder)
        set_aside_damaged_state(folder)
        return _fit(experiment, verbose, interrupted or (lambda: False))


def _fit(experiment: Experiment, verbose: bool, interrupted: Callable[[], bool]):
    os.environ["TUNE_GLOBAL_CHECKPOINT_S"] = "1"  # read when the Tuner starts; a SIGKILL then loses <= 1 s of state
    os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")  # early stages report no acc_mean yet
    if not verbose:  # Tune's new console prints its configuration box even at verbose 0; the classic one does not
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    _start_ray(verbose)
    path = experiment_path(experiment)
    final_stage = zero_shot_stage(experiment.evaluation.fidelities[-1])
    from taylor_tune.sweep.tune.trainable import sweep_trainable  # the trial's stack, once Tune is to run it

    trainable = tune.with_resources(sweep_trainable, _resources(experiment))
    if tune.Tuner.can_restore(path) and has_state(path):  # else afresh: finished trials are reused from their folders
        tuner = tune.Tuner.restore(path, trainable=trainable, resume_errored=True)
    else:
        scheduler = None
        if experiment.search.scheduler == "asha":
            scheduler = FidelityASHA(
                len(experiment.evaluation.fidelities), recovery_points=experiment.recovery_points(),
                reduction_factor=experiment.search.reduction_factor,
            )
        elif experiment.search.scheduler == "race":
            scheduler = RaceScheduler(path, alpha=experiment.search.alpha, objective=experiment.metric)
        cache_dir = cache_folder(path)
        if experiment.search.algorithm == "grid":
            search_alg, num_samples, space = None, 1, param_space(experiment, cache_dir=cache_dir)
        else:
            search_alg = PerModelSearcher(
                experiment.models,
                domains_of(experiment),
                experiment.search.num_trials,
                fixed_settings(experiment, cache_dir),
                metric=experiment.metric,
                mode=experiment.mode,
                objectives=experiment.objective_list,
                seed=experiment.search.seed,
                n_startup_trials=experiment.search.n_startup_trials,
            )
            num_samples, space = experiment.grid_size(), {}
        tuner = tune.Tuner(
            trainable,
            param_space=space,
            # reuse_actors: a new trial runs in the previous trial's worker, which keeps torch, transformers and
            # lm-eval imported (~4 s per trial here); the trainable asks the session for its own folders
            tune_config=tune.TuneConfig(
                metric=experiment.metric,
                mode=experiment.mode,
                scheduler=scheduler,
                search_alg=search_alg,
                num_samples=num_samples,
                max_concurrent_trials=experiment.search.max_concurrent,
                reuse_actors=True,
            ),
            run_config=tune.RunConfig(
                name=experiment.name,
                storage_path=joined(experiment.storage_path),
                failure_config=tune.FailureConfig(max_failures=experiment.max_failures),
                verbose=1 if verbose else 0,
                sync_config=tune.SyncConfig(sync_artifacts=True),  # the trial's artifacts reach storage from any node
                callbacks=[
                    SweepMetricsCallback(experiment.name, final_stage, experiment.metric, experiment.mode),
                    FullStorage(experiment.storage_path),
                    ConsoleCallback(final_stage, storage=experiment.storage_path, total=experiment.grid_size()),
                    KeptReports(),
                ],
            ),
        )
    if interrupted():
        raise KeyboardInterrupt
    leases = start_leases(cache_folder(path))  # held while the sweep runs (leases.start_leases)
    previous = signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    try:
        with quiet_when_full(experiment.storage_path):
            return tuner.fit()
    finally:
        signal.signal(signal.SIGTERM, previous)
        del leases
