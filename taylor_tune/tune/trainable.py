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
    import os

    os.environ.setdefault("TQDM_DISABLE", "1")
    run_trial(trial_config(config), tune.get_context().get_trial_dir(), report=tune.report)
