"""The function trainable: one Tune trial = `trial.run_trial` with Tune's report and trial folder."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import ray
from ray import tune

from taylor_tune.compat.ray import trial_storage
from taylor_tune.schema import zero_shot_stage
from taylor_tune.storage.cache import StoreStats
from taylor_tune.storage.folder import copy_out, sibling_folders_holding, upload
from taylor_tune.storage.names import PPL_WINDOWS_FILE, outcomes_file
from taylor_tune.sweep.trial import FINISHED_ARTIFACTS, TrialConfig, completed_metrics, run_trial
from taylor_tune.sweep.tune.leases import RayLeases
from taylor_tune.sweep.tune.metrics import TrialMetrics


def trial_config(config: dict) -> TrialConfig:
    return TrialConfig.from_params(config)


def _same_configuration_elsewhere(storage, trial: TrialConfig) -> Iterator[str]:
    """The experiment's other trial folders whose config.json is this trial's configuration: an earlier run's, when
    the sweep started afresh (its experiment state was lost) and Tune gave the configuration a new trial id."""
    return sibling_folders_holding(storage.storage_filesystem, storage.trial_fs_path, "config.json", trial.record())


def _finished_before(checkpoint, storage, trial: TrialConfig, working: Path) -> dict | None:
    """The final metrics of this trial's earlier run, from its checkpoint, else its storage folder, else another
    trial folder of the experiment that finished this configuration, with its artifacts copied into `working`; None
    when none finished it."""
    with tempfile.TemporaryDirectory() as tmp:
        if checkpoint is not None:
            folder = Path(checkpoint.to_directory(tmp))
        else:
            folder = Path(tmp)
            # the other folders are listed only when this trial's own holds no finished run
            sources = itertools.chain([storage.trial_fs_path], _same_configuration_elsewhere(storage, trial))
            if not any(copy_out(storage.storage_filesystem, source, FINISHED_ARTIFACTS, folder)
                       and completed_metrics(folder, trial) is not None for source in sources):
                return None
        done = completed_metrics(folder, trial)
        if done is not None:
            working.mkdir(parents=True, exist_ok=True)
            for name in FINISHED_ARTIFACTS:
                shutil.copy2(folder / name, working / name)
    return done


def _upload(storage, working: Path, name: str, stats: StoreStats) -> None:
    """A file of the trial's working folder into its folder in storage (`storage.folder.upload`)."""
    upload(storage.storage_filesystem, f"{storage.trial_fs_path}/{name}", (working / name).read_bytes(), stats)


def node_copies() -> Path:
    """This node's copies of shared entries read from object storage (`storage.cache.Store`), named by their checksum:
    one folder per Ray node, so that nodes that happen to share a machine still keep copies of their own."""
    node = ray.get_runtime_context().get_node_id()
    return Path(tempfile.gettempdir()) / f"taylor_tune_copies_{os.getuid()}" / node


def sweep_trainable(config: dict) -> None:
    """Artifacts go to the trial's working directory on whichever node runs it; Tune uploads that folder to
    the trial's folder in storage (RunConfig's SyncConfig(sync_artifacts=True)), so they arrive on shared or
    cloud storage from any node, and a reused actor (reuse_actors=True) gets each new trial's own folders.

    The final report carries a checkpoint of the finished artifacts, and just before it they are copied to the trial's
    folder in storage. A trial that Tune runs again after a restore (killed after its final report, before Tune
    recorded it finished) finds that checkpoint, or, when the driver was killed before its saved state recorded the
    checkpoint (it saves every second), the copy in its storage folder; if either holds this configuration's complete
    results (`trial.completed_metrics`) it reports them instead of recomputing."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    context = tune.get_context()
    storage = trial_storage(context)  # the paths of *this* trial, also in a reused worker
    emit = TrialMetrics(context.get_experiment_name(), config["model"], context.get_trial_id())
    trial = trial_config(config)
    final_stage = zero_shot_stage(trial.evaluation.fidelities[-1])
    working = Path(storage.trial_working_directory)

    done = _finished_before(tune.get_checkpoint(), storage, trial, working)
    if done is not None:
        emit.observe(done)
        tune.report({**done, "reused_artifacts": True})
        return

    stats = StoreStats()  # what the trial's storage cost: its uploads here, its shared caches in run_trial

    def report(metrics: dict) -> None:
        emit.observe(metrics)
        # in storage before the report: what a racing scheduler compares (a pass's items, or the windows so far)
        name = None
        if "zero_shot_pass" in metrics:
            name = outcomes_file(metrics["stage"])
        elif "ppl_pass" in metrics:  # a perplexity pass (the zero-shot passes after it carry zero_shot_pass)
            name = PPL_WINDOWS_FILE
        if name is not None:
            _upload(storage, working, name, stats)
        if metrics.get("stage") != final_stage:
            tune.report(metrics)
            return
        for name in FINISHED_ARTIFACTS:  # in storage before the report: found on a rerun whatever Tune saved
            _upload(storage, working, name, stats)
        with tempfile.TemporaryDirectory() as folder:  # the finished artifacts only: a few small JSON files
            for name in FINISHED_ARTIFACTS:
                shutil.copy2(working / name, Path(folder) / name)
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(folder))

    leases = None if trial.cache_dir is None else RayLeases.of_sweep(trial.cache_dir)
    run_trial(trial, working, report=report, output_dir=storage.trial_fs_path, leases=leases, copies=node_copies(),
              stats=stats)
