"""One trial of a sweep, without Ray: the stages of `trial_stages`, in order, each adding its metrics and seconds.

unpruned speed -> load -> score -> plan -> apply (pruning's own stage functions) -> speed -> recovery (when asked;
with `evaluate_before`, the pruned model evaluated first) -> perplexity -> each zero-shot pass. `report` is called
with the cumulative metrics after each stage that ends a step ASHA may stop at, and at each point of the recovery's
held-out loss curve (the Ray trainable passes `tune.report`, so a trial can be stopped before its expensive
evaluation); the artifacts go to `trial_dir`. The importance comes from the sweep's shared cache when one is given.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from taylor_tune import schema
from taylor_tune.config import PruneConfig, RecoverySpec, dimensions
from taylor_tune.evaluation.evaluate import Evaluator
from taylor_tune.evaluation.requests import RequestCache
from taylor_tune.evaluation.speed import SPEEDUPS, checked_speed, measure_speed, speed_ratios
from taylor_tune.jsonio import built_once, digest, json_safe, write_json
from taylor_tune.pruning import prune as stages
from taylor_tune.pruning.prune import ImportanceCache, Pruning, layer_shapes, summary_dict
from taylor_tune.recovery.train import heldout_ids, recover, recovery_data
from taylor_tune.sources.data import resolve_text
from taylor_tune.sources.models import load_model, resolve_device, resolve_dtype
from taylor_tune.sweep.experiment import Evaluation
from taylor_tune.sweep.lock import timing_lock

log = logging.getLogger(__name__)


class TrialConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    prune: PruneConfig
    evaluation: Evaluation
    sample_counts: tuple[int, ...] = ()  # every num_samples of the search: one cached pass serves them all
    cache_dir: str | None = None
    recovery: RecoverySpec | None = None  # LoRA recovery between pruning and evaluation (None: off)

    def record(self) -> dict:
        """The trial's config.json: every field, but `recovery` only when set (so that the record of a trial
        without recovery is what it was before recovery existed, and a finished trial of an older sweep is found
        finished)."""
        return json.loads(json.dumps(json_safe(self.model_dump(exclude={"recovery"} if self.recovery is None
                                                                else set()))))


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


def unpruned_speed(trial: TrialConfig, *, again: bool = False) -> tuple[dict, float | None]:
    """The unpruned model's speed (`measure_speed`) on this trial's device, and the seconds measuring it cost this
    trial (None when read). Measured once per model, dtype, device and settings in a sweep: the first trial to ask
    measures under a file lock, the others read its result. `again`: the sweep's record is dropped and measured anew
    (a record the trial's own measurement shows to be implausible)."""
    config, spec = trial.prune, trial.evaluation.speed
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)

    def measure() -> tuple[dict, float]:
        start = time.perf_counter()
        model = load_model(config.model, device=device, dtype=dtype, trust_remote_code=config.trust_remote_code,
                           seed=config.seed)
        with timing_lock():
            measured = measure_speed(model, spec, seed=config.seed)
        del model  # before the trial loads its own copy
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return measured, time.perf_counter() - start

    if trial.cache_dir is None:
        return measure()
    fields = {"model": config.model, "dtype": str(dtype), "device": machine(device), "speed": spec.model_dump()}
    path = Path(trial.cache_dir).parent / "unpruned_speed" / f"{digest(fields)[:24]}.json"
    spent = {}

    def build() -> dict:
        measured, spent["seconds"] = measure()
        return measured

    if again:
        path.unlink(missing_ok=True)
    measured, _ = built_once(path, fields, build, checked_speed, part="measured")
    return measured, spent.get("seconds")


def machine(device: torch.device) -> str:
    """What a speed measurement is of: the GPU's name, or this host's CPU (a sweep's nodes may differ)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu@{socket.gethostname()}"


def layer_analysis(diagnostics: dict) -> list[dict]:
    grad_mean, grad_norm = diagnostics["layer_grad_mean"], diagnostics["layer_grad_norm"]
    return [
        {
            "layer": i,
            "pruning_ratio": r,
            "retention_ratio": 1 - r,
            "attention_groups_kept": diagnostics["attention_groups_kept"][i],
            "mlp_channels_kept": diagnostics["mlp_channels_kept"][i],
            "grad_mean": None if grad_mean is None else grad_mean[i],
            "grad_norm": None if grad_norm is None else grad_norm[i],
        }
        for i, r in enumerate(diagnostics["layer_pruning_ratio"])
    ]


@dataclass
class TrialRun:
    """What a trial's stages share: its settings, the pruning they build, and the metrics so far."""

    trial: TrialConfig
    trial_dir: Path
    metrics: dict[str, Any]
    pruning: Pruning | None = None
    unpruned: dict | None = None  # the unpruned model's speed, when the trial measures speed
    unpruned_read: bool = False  # read from the sweep's record (not measured by this trial)
    evaluator: Evaluator | None = None
    report: Callable[[dict], None] = lambda metrics: None  # what Tune hears (run_trial's `report`)
    on_gpu: bool = False

    @property
    def config(self) -> PruneConfig:
        return self.trial.prune


@dataclass(frozen=True)
class Stage:
    """One step of a trial: `run` adds its metrics (and seconds) to the trial's; `reports`: Tune hears the metrics
    after it (a step ASHA may stop the trial at)."""

    name: str
    run: Callable[[TrialRun], dict | None]
    reports: bool = False


def measure_unpruned(run: TrialRun) -> dict:
    if run.trial.evaluation.speed is None:
        return {}
    run.unpruned, seconds = unpruned_speed(run.trial)
    run.unpruned_read = seconds is None
    if run.on_gpu:
        torch.cuda.reset_peak_memory_stats()
    return {} if seconds is None else {"unpruned_speed_s": seconds}  # None: read from the sweep's record


def start_pruning(run: TrialRun) -> dict:
    """Checks against the model's config, the tokenizer, and the shared importance cache when the sweep has one."""
    cache = None if run.trial.cache_dir is None else ImportanceCache(run.trial.cache_dir)
    run.pruning = stages.start(run.config, cache=cache, sample_counts=run.trial.sample_counts)
    return {}


def pruning_stage(step: Callable[[Pruning], dict]) -> Callable[[TrialRun], dict]:
    """A stage of pruning's own (load, score, plan, apply), its seconds kept in the pruning summary too."""

    def run_step(run: TrialRun) -> dict:
        timings = step(run.pruning)
        run.pruning.timings |= timings
        return timings

    return run_step


def write_pruned(run: TrialRun) -> dict:
    """The pruning's files, and its columns: the configuration, what was removed, the importance cache's event."""
    result, config = run.pruning, run.config
    write_json(run.trial_dir / "pruning_summary.json", summary_dict(config, result))
    write_json(run.trial_dir / "layer_analysis.json", layer_analysis(result.diagnostics))
    metrics = {k: result.diagnostics[k] for k in ("params_count", "params_count_before", "pruning_ratio",
                                                  "extreme_pruning_layers", "grad_mean_ratio", "grad_norm_ratio",
                                                  "grad_mean_range", "grad_norm_range")}
    cache = {} if result.importance_cache is None else {"importance_cache": result.importance_cache}
    return metrics | cache | {"stage": "pruned"}


def measure_pruned_speed(run: TrialRun) -> dict:
    """The pruned model's speed, timed under the node's timing lock (no other trial times at the same moment; the
    window is reported as speed_timed_from / _to, epoch seconds); in a sweep, a model whose layer shapes an earlier
    trial of the sweep timed on the same machine, dtype and settings reads that measurement (speed_reused)."""
    start, spec, model = time.perf_counter(), run.trial.evaluation.speed, run.pruning.model
    timing: dict = {}

    def measure() -> dict:
        with timing_lock() as waited:
            timing["speed_timed_from"] = time.time()
            measured = measure_speed(model, spec, seed=run.config.seed)
            timing["speed_timed_to"] = time.time()
        timing["speed_wait_s"] = waited
        return measured

    if run.trial.cache_dir is None:
        measured = measure()
    else:
        parameter = next(model.parameters())
        fields = {"model": run.config.model, "dtype": str(parameter.dtype), "device": machine(parameter.device),
                  "speed": spec.model_dump(), "layers": layer_shapes(model)}
        path = Path(run.trial.cache_dir).parent / "pruned_speed" / f"{digest(fields)[:24]}.json"
        measured, _ = built_once(path, fields, measure, checked_speed, part="measured")
    ratios, again = speed_ratios(measured, run.unpruned), {}
    if run.unpruned_read and not plausible(ratios):  # a record damaged in a way its checks cannot see: measure it
        log.warning("the sweep's unpruned speed record gives %s against this trial's own measurement: measured "
                    "again", ", ".join(f"{k} {ratios[k]:.3g}" for k in SPEEDUPS))
        run.unpruned, seconds = unpruned_speed(run.trial, again=True)
        ratios, again = speed_ratios(measured, run.unpruned), {"unpruned_speed_s": seconds or 0.0}
    return (measured | ratios | {f"unpruned_{k}": v for k, v in run.unpruned.items()} | again
            | timing | {"speed_reused": not timing, "stage": "speed", "speed_s": time.perf_counter() - start})


# A speedup beyond this factor either way is read as a damaged unpruned record, not a measurement: no structured
# pruning the tool allows makes a model twenty times faster or slower
PLAUSIBLE_SPEEDUP = 20.0


def plausible(ratios: dict) -> bool:
    return all(1 / PLAUSIBLE_SPEEDUP <= ratios[k] <= PLAUSIBLE_SPEEDUP for k in SPEEDUPS)


def recover_pruned(run: TrialRun) -> dict:
    """LoRA recovery of the pruned model (recovery.train), its adapters merged: the evaluation then scores the
    recovered model. The held-out loss before, every `eval_every` steps (each a report) and after; the unpruned model
    is loaded as the teacher (in the pruned model's dtype and device) only for kd and ce+kd, and freed after."""
    spec, config, pruned = run.trial.recovery, run.config, run.pruning
    parameter = next(pruned.model.parameters())
    teacher = None if spec.loss == "ce" else load_model(
        config.model, device=parameter.device, dtype=parameter.dtype, trust_remote_code=config.trust_remote_code,
        seed=config.seed)
    text = resolve_text(run.trial.evaluation.ppl or "auto", config.model)
    held = heldout_ids(pruned.tokenizer, text, spec)

    points = iter(range(1, spec.steps + 1))  # the curve's points after step 0, counted: ASHA's recovery rungs

    def report_curve(step: int, loss: float, train_loss: float) -> None:
        run.report({**run.metrics, "stage": schema.recovery_stage(step), "recovery_step": step,
                    "recovery_point": next(points), "recovery_heldout_loss": loss, "recovery_train_loss": train_loss})

    ids, mask = recovery_data(pruned.tokenizer, spec, config.model)
    recovered = recover(pruned.model, ids, held, spec, mask=mask, teacher=teacher, report=report_curve)
    del teacher
    if parameter.device.type == "cuda":
        torch.cuda.empty_cache()
    pruned.model = recovered.model
    tail = recovered.train_loss[(spec.points - 1) * (spec.eval_every or 0):]  # the steps since the last point
    return {"recovery_heldout_loss_before": recovered.loss_before, "recovery_heldout_loss_after": recovered.loss_after,
            "recovery_heldout_loss": recovered.loss_after, "recovery_step": spec.steps,
            "recovery_point": next(points), "recovery_train_loss_last": recovered.train_loss[-1],
            "recovery_train_loss": sum(tail) / len(tail),
            "recovery_heldout_ppl_before": math.exp(recovered.loss_before),
            "recovery_heldout_ppl_after": math.exp(recovered.loss_after), "recovery_s": recovered.seconds,
            "stage": schema.recovery_stage(None)}


def evaluate_before_recovery(run: TrialRun) -> dict:
    """The pruned model's perplexity and last zero-shot pass before recovery (`recovery.evaluate_before`), each
    metric under schema.before_recovery_key: what recovery is then measured against, on the evaluation's own
    numbers."""
    trial, start = run.trial, time.perf_counter()
    evaluator = Evaluator(run.pruning.model, run.pruning.tokenizer, trial.evaluation.spec(None),
                          model_name=run.config.model, request_cache=request_cache(trial))
    metrics = {}
    if trial.evaluation.ppl is not None:
        metrics["ppl"] = evaluator.perplexity().ppl
    if trial.evaluation.tasks:
        shots = evaluator.zero_shot(trial.evaluation.fidelities[-1])
        metrics["acc_mean"] = shots.acc_mean
        for task, entry in shots.tasks.items():
            metrics[schema.task_key(task)] = entry["score"]
            metrics[schema.task_key(task, "_stderr")] = entry["score_stderr"]
            metrics[schema.task_key(task, "_n")] = entry["n"]
    return {schema.before_recovery_key(k): v for k, v in metrics.items()} | {
        schema.seconds_key("before_recovery"): time.perf_counter() - start}


def request_cache(trial: TrialConfig) -> RequestCache | None:
    """The sweep's zero-shot requests: built by the model's first trial, read by the others (beside the importance
    cache); None outside a sweep."""
    return None if trial.cache_dir is None else RequestCache(Path(trial.cache_dir).parent / "requests")


def start_evaluation(run: TrialRun) -> dict:
    run.evaluator = Evaluator(run.pruning.model, run.pruning.tokenizer, run.trial.evaluation.spec(None),
                              model_name=run.config.model, request_cache=request_cache(run.trial))
    return {}


def perplexity(run: TrialRun) -> dict:
    result = run.evaluator.perplexity()
    result.write_outcomes(run.trial_dir)  # each window's NLL, before the report
    return result.metrics() | {"stage": "ppl"}


def zero_shot_pass(index: int) -> Callable[[TrialRun], dict]:
    """The zero-shot pass at the index-th fidelity: each writes its items' outcomes, the last one evaluation.json
    (before its report, so a checkpoint of it can carry the files)."""

    def zero_shot(run: TrialRun) -> dict:
        fidelities = run.trial.evaluation.fidelities
        shots = run.evaluator.zero_shot(fidelities[index])
        shots.write_outcomes(run.trial_dir)  # before the report, so that its checkpoint carries them
        metrics = shots.metrics() | {"zero_shot_pass": index, "stage": shots.stage}
        if run.on_gpu:  # the trial's peak so far; the last report carries the whole trial's (pruning + evaluation)
            metrics["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated()
        if index == len(fidelities) - 1:
            write_json(run.trial_dir / "evaluation.json",
                       {**run.metrics, **metrics, "tasks": shots.tasks, "limit": fidelities[index]})
        return metrics

    return zero_shot


def trial_stages(trial: TrialConfig) -> list[Stage]:
    """A trial's stages, in the order they run."""
    evaluation = trial.evaluation
    return [
        Stage("unpruned_speed", measure_unpruned),
        Stage("start", start_pruning),
        Stage("load", pruning_stage(stages.load)),
        Stage("score", pruning_stage(stages.score)),
        Stage("plan", pruning_stage(stages.plan)),
        Stage("apply", pruning_stage(stages.apply)),
        Stage("pruned", write_pruned, reports=True),
        *([Stage("speed", measure_pruned_speed, reports=True)] if evaluation.speed is not None else []),
        *([Stage("before_recovery", evaluate_before_recovery)]
          if trial.recovery is not None and trial.recovery.evaluate_before else []),
        *([Stage("recovery", recover_pruned, reports=True)] if trial.recovery is not None else []),
        Stage("evaluator", start_evaluation),
        *([Stage("ppl", perplexity, reports=True)] if evaluation.ppl is not None else []),
        *(Stage(f"zero_shot_{i}", zero_shot_pass(i), reports=True) for i in range(len(evaluation.fidelities))),
    ]


def run_trial(trial: TrialConfig, trial_dir: str | Path, report: Callable[[dict], None] = lambda metrics: None,
              output_dir: str | None = None) -> dict:
    """Run one trial's stages in order, writing its artifacts to `trial_dir`; `output_dir` is where they will live
    for good (the trial's folder in the sweep's storage), reported as the `output_dir` column; default `trial_dir`."""
    trial_dir = Path(trial_dir)
    trial_dir.mkdir(parents=True, exist_ok=True)
    write_json(trial_dir / "config.json", trial.record())
    metrics = {**trial_columns(trial.prune, trial.recovery), "output_dir": output_dir or str(trial_dir)}
    run = TrialRun(trial, trial_dir, metrics, on_gpu=torch.cuda.is_available() and trial.prune.device != "cpu",
                   report=report)
    for stage in trial_stages(trial):
        metrics |= stage.run(run) or {}
        if stage.reports:
            report(dict(metrics))
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
