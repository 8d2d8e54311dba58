"""One trial of a sweep, without Ray: prune -> perplexity -> zero-shot at each fidelity, reporting after each.

`report` is called with the cumulative metrics after every stage (the Ray trainable passes `tune.report`,
so ASHA can stop a trial before its expensive evaluation); the artifacts go to `trial_dir`. The importance
comes from the sweep's shared cache when one is given.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from taylor_tune import schema
from taylor_tune.config import PruneConfig
from taylor_tune.evaluation.evaluate import Evaluator
from taylor_tune.evaluation.requests import RequestCache
from taylor_tune.evaluation.speed import checked_speed, measure_speed, speed_ratios
from taylor_tune.jsonio import built_once, json_safe, write_json
from taylor_tune.pruning.artifacts import summary_dict
from taylor_tune.pruning.importance import check_importance, compute_importance
from taylor_tune.pruning.prune import ProvidedImportance, prune
from taylor_tune.sources.calibration import load_calibration
from taylor_tune.sources.data import resolve_text
from taylor_tune.sources.models import load_model, resolve_device, resolve_dtype
from taylor_tune.sweep.experiment import Evaluation
from taylor_tune.sweep.importance_cache import ImportanceCache, cache_key


class TrialConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    prune: PruneConfig
    evaluation: Evaluation
    sample_counts: tuple[int, ...] = ()  # every num_samples of the search: one cached pass serves them all
    cache_dir: str | None = None


def trial_columns(config: PruneConfig) -> dict:
    """The configuration columns of the consolidated table (docs/specification.md §3) and every other setting a
    search may vary (schema.DIMENSIONS), whether this sweep varied it or not."""
    columns = schema.config_columns(config.model, config.method, config.seq_len, config.num_samples, config.seed)
    return columns | {name: getattr(config, field) for name, field in schema.DIMENSIONS.items() if name not in columns}


def cached_importance(trial: TrialConfig):
    """An importance provider backed by the shared cache (None: compute inside the trial)."""
    if trial.cache_dir is None:
        return None
    config = trial.prune
    counts = sorted(set(trial.sample_counts) | {config.num_samples})
    largest = counts[-1]
    cache = ImportanceCache(trial.cache_dir)

    def provide(model, layout, tokenizer) -> ProvidedImportance:
        # keyed by the dtype and device the model was loaded in, not the config's `auto`: an entry computed on a CPU in
        # float32 must not serve a GPU trial in bfloat16 (a sweep resumed on other hardware)
        parameter = next(model.parameters())
        fields = importance_fields(config, dtype=parameter.dtype, device=parameter.device)
        drawn = {}

        def compute():  # only on a miss: a hit needs neither the corpus nor the tokenizer's time
            start = time.perf_counter()
            drawn["ids"] = load_calibration(
                tokenizer,
                resolve_text(config.calibration, config.model),
                seq_len=config.seq_len,
                num_samples=largest,
                seed=config.seed,
            )
            drawn["seconds"] = time.perf_counter() - start
            return compute_importance(
                model, layout, drawn["ids"], micro_batch_size=config.micro_batch_size, snapshots=counts
            )

        start = time.perf_counter()
        results = cache.get_or_compute(fields, counts, compute, check=lambda imp: check_importance(imp, layout))
        seconds, ids = time.perf_counter() - start, drawn.get("ids")
        # on a miss the draw happened inside: a stage of its own, as in a trial without the cache
        timings = (
            {"importance_s": seconds - drawn["seconds"], "calibration_s": drawn["seconds"]}
            if ids is not None
            else {"importance_s": seconds}
        )
        return ProvidedImportance(results[config.num_samples], None if ids is None else ids[: config.num_samples],
                                  cache.last_event, timings)

    return provide


def importance_fields(config: PruneConfig, *, dtype: torch.dtype, device: torch.device) -> dict:
    """What an importance pass depends on: the cache key's fields, with the dtype and device type resolved."""
    return {
        "model": config.model,
        "calibration": resolve_text(config.calibration, config.model),
        "seq_len": config.seq_len,
        "seed": config.seed,
        "dtype": str(dtype).removeprefix("torch."),
        "device": torch.device(device).type,
        "micro_batch_size": config.micro_batch_size,
    }


def unpruned_speed(trial: TrialConfig) -> tuple[dict, float | None]:
    """The unpruned model's speed (`measure_speed`) on this trial's device, and the seconds measuring it cost this
    trial (None when read). Measured once per model, dtype, device and settings in a sweep: the first trial to ask
    measures under a file lock, the others read its result."""
    config, spec = trial.prune, trial.evaluation.speed
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)

    def measure() -> tuple[dict, float]:
        start = time.perf_counter()
        model = load_model(config.model, device=device, dtype=dtype, trust_remote_code=config.trust_remote_code,
                           seed=config.seed)
        measured = measure_speed(model, spec, seed=config.seed)
        del model  # before the trial loads its own copy
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return measured, time.perf_counter() - start

    if trial.cache_dir is None:
        return measure()
    # the machine is part of the key: a sweep's nodes may differ (another GPU, another CPU)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu@{socket.gethostname()}"
    fields = {"model": config.model, "dtype": str(dtype), "device": where, "speed": spec.model_dump()}
    path = Path(trial.cache_dir).parent / "unpruned_speed" / f"{cache_key(**fields)}.json"
    spent = {}

    def build() -> dict:
        measured, spent["seconds"] = measure()
        return measured

    measured, _ = built_once(path, fields, build, checked_speed, part="measured")
    return measured, spent.get("seconds")


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


def run_trial(trial: TrialConfig, trial_dir: str | Path, report: Callable[[dict], None] = lambda metrics: None,
              output_dir: str | None = None) -> dict:
    """Run one trial, writing its artifacts to `trial_dir`; `output_dir` is where they will live for good
    (the trial's folder in the sweep's storage), reported as the `output_dir` column; default `trial_dir`."""
    trial_dir = Path(trial_dir)
    trial_dir.mkdir(parents=True, exist_ok=True)
    config = trial.prune
    write_json(trial_dir / "config.json", trial.model_dump())

    on_gpu = torch.cuda.is_available() and config.device != "cpu"
    unpruned, unpruned_s = unpruned_speed(trial) if trial.evaluation.speed is not None else (None, None)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    result = prune(config, importance_provider=cached_importance(trial))
    diagnostics = result.diagnostics
    write_json(trial_dir / "pruning_summary.json", summary_dict(config, result))
    write_json(trial_dir / "layer_analysis.json", layer_analysis(diagnostics))
    metrics: dict[str, Any] = {
        **trial_columns(config), "output_dir": output_dir or str(trial_dir), "stage": "pruned",
        **{k: diagnostics[k] for k in ("params_count", "params_count_before", "pruning_ratio", "extreme_pruning_layers",
                                       "grad_mean_ratio", "grad_norm_ratio", "grad_mean_range", "grad_norm_range")},
        **result.timings,
    }
    if result.importance_cache is not None:
        metrics["importance_cache"] = result.importance_cache
    report(dict(metrics))

    if unpruned is not None:
        start = time.perf_counter()
        measured = measure_speed(result.model, trial.evaluation.speed, seed=config.seed)
        metrics |= measured | speed_ratios(measured, unpruned) | {f"unpruned_{k}": v for k, v in unpruned.items()}
        if unpruned_s is not None:  # this trial measured the unpruned model (absent: read from the sweep's record)
            metrics["unpruned_speed_s"] = unpruned_s
        metrics |= {"stage": "speed", "speed_s": time.perf_counter() - start}
        report(dict(metrics))

    evaluation = trial.evaluation
    # the zero-shot requests: built by the model's first trial, read by the others (beside the importance cache)
    requests = None if trial.cache_dir is None else RequestCache(Path(trial.cache_dir).parent / "requests")
    evaluator = Evaluator(result.model, result.tokenizer, evaluation.spec(None), model_name=config.model,
                          request_cache=requests)
    if evaluation.ppl is not None:
        metrics |= evaluator.perplexity().metrics() | {"stage": "ppl"}
        report(dict(metrics))
    for index, limit in enumerate(evaluation.fidelities):
        shots = evaluator.zero_shot(limit)
        metrics |= shots.metrics() | {"zero_shot_pass": index, "stage": shots.stage}
        if on_gpu:  # the trial's peak so far; the last report carries the whole trial's (pruning + evaluation)
            metrics["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated()
        if index == len(evaluation.fidelities) - 1:  # before the final report, so a checkpoint of it can carry the file
            write_json(trial_dir / "evaluation.json", {**metrics, "tasks": shots.tasks, "limit": limit})
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
    if written != json.loads(json.dumps(json_safe(trial.model_dump()))):
        return None
    if evaluation.get("stage") != schema.zero_shot_stage(trial.evaluation.fidelities[-1]):
        return None
    metrics = {k: v for k, v in evaluation.items() if k not in ("tasks", "limit")}
    return {k: float(v) if v in ("inf", "-inf") else v for k, v in metrics.items()}  # as the trial reported them
