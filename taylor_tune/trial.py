"""One trial of a sweep, without Ray: prune -> perplexity -> zero-shot at each fidelity, reporting after each.

`report` is called with the cumulative metrics after every stage (the Ray trainable passes `tune.report`,
so ASHA can stop a trial before its expensive evaluation); the artifacts go to `trial_dir`. The importance
comes from the sweep's shared cache when one is given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from taylor_tune.config import PruneConfig
from taylor_tune.experiment import Evaluation, zero_shot_stage
from taylor_tune.jsonio import json_safe, write_json

log = logging.getLogger(__name__)


class TrialConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    prune: PruneConfig
    evaluation: Evaluation
    sample_counts: tuple[int, ...] = ()  # every num_samples of the search: one cached pass serves them all
    cache_dir: str | None = None
    fault: dict[str, Any] | None = None  # test-only fault injection: {field: value, ...} of the configs to fail


class InjectedFault(RuntimeError):
    """Raised on purpose by a test-only setting."""


def search_columns(config: PruneConfig) -> dict:
    """The configuration columns of the consolidated table (docs/specification.md §3)."""
    return {"model": config.model, "pruning_method": config.method, "taylor_seq_len": config.seq_len,
            "taylor_num_samples": config.num_samples, "seed": config.seed, "sparsity": config.sparsity}


def cached_importance(trial: TrialConfig):
    """An importance provider backed by the shared cache (None: compute inside the trial)."""
    if trial.cache_dir is None:
        return None
    from taylor_tune.calibration import load_calibration
    from taylor_tune.importance import compute_importance
    from taylor_tune.importance_cache import ImportanceCache
    from taylor_tune.models import resolve_text
    from taylor_tune.prune import ProvidedImportance

    config = trial.prune
    counts = sorted(set(trial.sample_counts) | {config.num_samples})
    largest = counts[-1]
    cache = ImportanceCache(trial.cache_dir)
    fields = {"model": config.model, "calibration": config.calibration, "seq_len": config.seq_len, "seed": config.seed,
              "dtype": config.dtype, "micro_batch_size": config.micro_batch_size}

    def provide(model, layout, tokenizer) -> ProvidedImportance:
        drawn = {}

        def compute():  # only on a miss: a hit needs neither the corpus nor the tokenizer's time
            start = time.perf_counter()
            drawn["ids"] = load_calibration(tokenizer, resolve_text(config.calibration, config.model), seq_len=config.seq_len, num_samples=largest, seed=config.seed)
            drawn["seconds"] = time.perf_counter() - start
            return compute_importance(model, layout, drawn["ids"], micro_batch_size=config.micro_batch_size, snapshots=counts)

        start = time.perf_counter()
        results = cache.get_or_compute(fields, counts, compute)
        seconds, ids = time.perf_counter() - start, drawn.get("ids")
        # on a miss the draw happened inside: a stage of its own, as in a trial without the cache
        timings = {"importance_s": seconds - drawn["seconds"], "calibration_s": drawn["seconds"]} if ids is not None else {"importance_s": seconds}
        return ProvidedImportance(results[config.num_samples], None if ids is None else ids[: config.num_samples],
                                  cache.last_event, timings)

    return provide


def layer_analysis(diagnostics: dict) -> list[dict]:
    grad_mean, grad_norm = diagnostics["layer_grad_mean"], diagnostics["layer_grad_norm"]
    return [
        {"layer": i, "pruning_ratio": r, "retention_ratio": 1 - r,
         "attention_groups_kept": diagnostics["attention_groups_kept"][i], "mlp_channels_kept": diagnostics["mlp_channels_kept"][i],
         "grad_mean": None if grad_mean is None else grad_mean[i], "grad_norm": None if grad_norm is None else grad_norm[i]}
        for i, r in enumerate(diagnostics["layer_pruning_ratio"])
    ]


def run_trial(trial: TrialConfig, trial_dir: str | Path, report: Callable[[dict], None] = lambda metrics: None,
              output_dir: str | None = None) -> dict:
    """Run one trial, writing its artifacts to `trial_dir`; `output_dir` is where they will live for good
    (the trial's folder in the sweep's storage), reported as the `output_dir` column; default `trial_dir`."""
    from taylor_tune.artifacts import summary_dict
    from taylor_tune.evaluation import check_window, load_ppl_text, make_lm, perplexity, resolve_task_data, zero_shot
    from taylor_tune.prune import prune
    from taylor_tune.models import resolve_text

    trial_dir = Path(trial_dir)
    trial_dir.mkdir(parents=True, exist_ok=True)
    config = trial.prune
    columns = search_columns(config)
    if trial.fault and all(columns.get(k) == v for k, v in trial.fault.items()):
        raise InjectedFault(f"injected fault for {trial.fault}")
    write_json(trial_dir / "config.json", trial.model_dump())

    import torch

    on_gpu = torch.cuda.is_available() and config.device != "cpu"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    result = prune(config, importance_provider=cached_importance(trial))
    diagnostics, timings = result.diagnostics, result.timings
    write_json(trial_dir / "pruning_summary.json", summary_dict(config, result))
    write_json(trial_dir / "layer_analysis.json", layer_analysis(diagnostics))
    metrics: dict[str, Any] = {
        **columns, "output_dir": output_dir or str(trial_dir), "stage": "pruned",
        **{k: diagnostics[k] for k in ("params_count", "params_count_before", "pruning_ratio", "extreme_pruning_layers",
                                       "grad_mean_ratio", "grad_norm_ratio", "grad_mean_range", "grad_norm_range")},
        **timings,
    }
    if result.importance_cache is not None:
        metrics["importance_cache"] = result.importance_cache
    report(dict(metrics))

    evaluation = trial.evaluation
    if evaluation.ppl is not None:
        check_window(evaluation.ppl_window, result.model.config)
        start = time.perf_counter()
        source = resolve_text(evaluation.ppl, config.model)
        metrics |= perplexity(result.model, result.tokenizer, load_ppl_text(source), window=evaluation.ppl_window,
                              max_windows=evaluation.ppl_max_windows)
        metrics["ppl_source"] = source
        metrics |= {"stage": "ppl", "ppl_s": time.perf_counter() - start}
        report(dict(metrics))

    lm = make_lm(result.model, result.tokenizer, evaluation.batch_size, evaluation.scorer)
    task_data = resolve_task_data(evaluation.spec(None), config.model)
    full = {}
    for index, limit in enumerate(evaluation.fidelities):
        tokens_before = lm.tokens_forwarded
        tasks, seconds = zero_shot(lm, evaluation.spec(limit), task_data)
        full = {"tasks": tasks, "limit": limit}
        metrics |= {f"acc_{t}": e["score"] for t, e in tasks.items()}
        metrics |= {f"acc_{t}_stderr": e["score_stderr"] for t, e in tasks.items()}
        metrics |= {f"acc_{t}_n": e["n"] for t, e in tasks.items()}  # items scored: the report's Wilson intervals
        metrics |= {f"acc_{t}_{half}": e[f"score_{half}"] for t, e in tasks.items() for half in ("sel", "heldout")}
        metrics |= {"acc_mean": sum(e["score"] for e in tasks.values()) / len(tasks), "fidelity": limit or 0, "zero_shot_pass": index,
                    "stage": zero_shot_stage(limit), f"{zero_shot_stage(limit)}_s": seconds, "scorer": evaluation.scorer,
                    f"{zero_shot_stage(limit)}_tokens": lm.tokens_forwarded - tokens_before}
        if on_gpu:  # the trial's peak so far; the last report carries the whole trial's (pruning + evaluation)
            metrics["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated()
        if index == len(evaluation.fidelities) - 1:  # before the final report, so a checkpoint of it can carry the file
            write_json(trial_dir / "evaluation.json", {**metrics, **full})
        report(dict(metrics))
    metrics["stage"] = "done"
    return metrics


FINISHED_ARTIFACTS = ("config.json", "pruning_summary.json", "layer_analysis.json", "evaluation.json")


def completed_metrics(folder: Path, trial: TrialConfig) -> dict | None:
    """The final metrics of a trial that already finished in `folder`, or None.

    Finished means: `evaluation.json` (written atomically, after every stage, before the final report) holds the
    final zero-shot pass, and `config.json` is this trial's configuration exactly. Then running it again would
    only repeat the same computation (prune and evaluate are deterministic for a config)."""
    import json

    try:
        written = json.loads((folder / "config.json").read_text())
        evaluation = json.loads((folder / "evaluation.json").read_text())
    except (OSError, ValueError):
        return None
    if written != json.loads(json.dumps(json_safe(trial.model_dump()))):
        return None
    if evaluation.get("stage") != zero_shot_stage(trial.evaluation.fidelities[-1]):
        return None
    metrics = {k: v for k, v in evaluation.items() if k not in ("tasks", "limit")}
    return {k: float(v) if v in ("inf", "-inf") else v for k, v in metrics.items()}  # as the trial reported them
