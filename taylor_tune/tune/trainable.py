"""The function trainable: one Tune trial = `trial.run_trial` with Tune's report and trial folder."""

from __future__ import annotations

from ray import tune

from taylor_tune.config import PruneConfig
from taylor_tune.experiment import Evaluation
from taylor_tune.trial import TrialConfig, run_trial


def trial_config(config: dict) -> TrialConfig:
    fixed = config["fixed"]
    prune = PruneConfig(model=config["model"], method=config["pruning_method"], seq_len=config["taylor_seq_len"],
                        num_samples=config["taylor_num_samples"], seed=config["seed"], **fixed["prune"])
    return TrialConfig(prune=prune, evaluation=Evaluation(**fixed["evaluation"]), sample_counts=tuple(fixed["sample_counts"]),
                       cache_dir=fixed["cache_dir"], fault=fixed["fault"])


def sweep_trainable(config: dict) -> None:
    """Artifacts go to the trial's working directory on whichever node runs it; Tune uploads that folder to
    the trial's folder in storage (RunConfig's SyncConfig(sync_artifacts=True)), so they arrive on shared or
    cloud storage from any node, and a reused actor (reuse_actors=True) gets each new trial's own folders."""
    import os

    from taylor_tune.tune.metrics import TrialMetrics

    os.environ.setdefault("TQDM_DISABLE", "1")
    context = tune.get_context()
    storage = context.get_storage()  # DeveloperAPI: the paths of *this* trial, also in a reused worker
    emit = TrialMetrics(context.get_experiment_name(), config["model"], context.get_trial_id())

    def report(metrics: dict) -> None:
        emit.observe(metrics)
        tune.report(metrics)

    run_trial(trial_config(config), storage.trial_working_directory, report=report, output_dir=storage.trial_fs_path)
