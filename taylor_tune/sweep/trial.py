"""One trial of a sweep, without Ray: the stages of `trial_stages`, in order, each adding its metrics and seconds.

start, load, score, plan, apply (pruning's own stage functions) -> pruned -> speed (timed in turn with the unpruned
model) -> recovery (when asked; with `evaluate_before`, the pruned model evaluated first) -> perplexity -> each
zero-shot pass. Each
stage's glue lives in `sweep.stages` (pruning, speed, recovery, evaluation). `report` is called with the cumulative
metrics after each stage that ends a step ASHA may stop at, and at each point of the recovery's held-out loss curve
(the Ray trainable passes `tune.report`, so a trial can be stopped before its expensive evaluation); the artifacts
go to `trial_dir`. The importance comes from the sweep's shared cache when one is given.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from taylor_tune import schema
from taylor_tune.config import PruneConfig, RecoverySpec, dimensions
from taylor_tune.jsonio import write_json
from taylor_tune.storage.cache import Leases, StoreStats
from taylor_tune.sweep.stages import evaluation, recovery, speed
from taylor_tune.sweep.stages.pruning import pruning_stages
from taylor_tune.sweep.stages.run import Stage, TrialConfig, TrialRun

__all__ = ["FINISHED_ARTIFACTS", "Stage", "TrialConfig", "completed_metrics", "run_trial", "trial_columns",
           "trial_stages"]


def trial_columns(config: PruneConfig, recovery: RecoverySpec | None = None) -> dict:
    """The configuration columns of the consolidated table (docs/specification.md §3) and every other setting a
    search may vary (the fields of the config's class marked `config.searchable`), whether this sweep varied it or
    not; with recovery, its settings too."""
    columns = schema.config_columns(config.model, config.method, config.seq_len, config.num_samples, config.seed)
    columns |= {name: getattr(config, field) for name, field in schema.prune_dimensions(type(config)).items()
                if name not in columns}
    if recovery is not None:
        columns |= {name: getattr(recovery, field) for name, field in dimensions(type(recovery)).items()}
    return columns


def trial_stages(trial: TrialConfig) -> list[Stage]:
    """A trial's stages, in the order they run."""
    fidelities, recovering = trial.evaluation.fidelities, trial.recovery is not None
    return [
        *pruning_stages(),
        *([Stage("speed", speed.measure, reports=True)] if trial.evaluation.speed is not None else []),
        *([Stage("before_recovery", evaluation.evaluate_before_recovery)]
          if recovering and trial.recovery.evaluate_before else []),
        *([Stage("recovery", recovery.recover, reports=True)] if recovering else []),
        Stage("evaluator", evaluation.start),
        *(Stage(f"ppl_{i}", evaluation.perplexity_pass(i), reports=True)
          for i in range(len(trial.evaluation.ppl_fidelities) if trial.evaluation.ppl is not None else 0)),
        *(Stage(f"zero_shot_{i}", evaluation.zero_shot_pass(i), reports=True) for i in range(len(fidelities))),
    ]


def run_trial(trial: TrialConfig, trial_dir: str | Path, report: Callable[[dict], None] = lambda metrics: None,
              output_dir: str | None = None, leases: Leases | None = None, copies: Path | None = None,
              stats: StoreStats | None = None) -> dict:
    """Run one trial's stages in order, writing its artifacts to `trial_dir`; `output_dir` is where they will live
    for good (the trial's folder in the sweep's storage), reported as the `output_dir` column; default `trial_dir`.
    `leases` decide who builds the sweep's shared entries (Ray's lease actor; None: lock files on a local folder),
    `copies` is this node's folder of entries read from object storage. With shared caches the metrics carry what
    their storage cost (`stats`, a `storage.StoreStats` the caller may share)."""
    trial_dir = Path(trial_dir)
    trial_dir.mkdir(parents=True, exist_ok=True)
    write_json(trial_dir / "config.json", trial.record())
    metrics = {**trial_columns(trial.prune, trial.recovery), "output_dir": output_dir or str(trial_dir)}
    run = TrialRun(trial, trial_dir, metrics, on_gpu=torch.cuda.is_available() and trial.prune.device != "cpu",
                   report=report, leases=leases, copies=copies, store_stats=stats or StoreStats())
    if run.on_gpu:  # the peak the last report carries is this trial's, whatever ran before in this process
        torch.cuda.reset_peak_memory_stats()
    try:
        for stage in trial_stages(trial):
            metrics |= stage.run(run) or {}
            if trial.cache_dir is not None:
                metrics |= run.store_stats.metrics()
            if stage.reports:
                report(dict(metrics))
    finally:  # a streamed trial's pruned model is the size of the model: not a record to keep
        if run.scratch is not None:
            shutil.rmtree(run.scratch, ignore_errors=True)
    metrics["stage"] = "done"
    return metrics


FINISHED_ARTIFACTS = ("config.json", "pruning_summary.json", "layer_analysis.json", "evaluation.json")


def completed_metrics(folder: Path, trial: TrialConfig) -> dict | None:
    """The final metrics of a trial that already finished in `folder`, or None.

    Finished means: `evaluation.json` (written atomically, after every stage, before the final report) holds the
    final zero-shot pass, and `config.json` is this trial's configuration exactly. Then running it again would
    only repeat the same computation (prune and evaluate are deterministic for a config)."""
    try:
        written = json.loads((folder / "config.json").read_text())
        evaluation = json.loads((folder / "evaluation.json").read_text())
    except (OSError, ValueError):
        return None
    if written != trial.record():
        return None
    if evaluation.get("stage") != schema.zero_shot_stage(trial.evaluation.fidelities[-1]):
        return None
    metrics = {k: v for k, v in evaluation.items() if k not in ("tasks", "limit")}
    return {k: float(v) if v in ("inf", "-inf") else v for k, v in metrics.items()}  # as the trial reported them
