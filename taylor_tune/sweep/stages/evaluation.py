"""The evaluation stages of a trial: perplexity and each zero-shot pass (each writing its per-item outcomes before
its report), and, with `recovery.evaluate_before`, the pruned model's evaluation before recovery. A sweep's
zero-shot requests are built by a model's first trial and read by the others."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from taylor_tune import schema
from taylor_tune.evaluation.evaluate import Evaluator
from taylor_tune.evaluation.requests import RequestCache
from taylor_tune.evaluation.zero_shot import task_sizes
from taylor_tune.jsonio import write_json
from taylor_tune.sweep.racing import Blocks, race_seed
from taylor_tune.sweep.stages.run import TrialRun


def evaluator(run: TrialRun) -> Evaluator:
    """An evaluator of the trial's model as it stands, reading and filling the sweep's request cache."""
    store = run.store("requests")  # beside the importance cache, the sweep's requests
    requests = None if store is None else RequestCache(store)
    return Evaluator(run.pruning.model, run.pruning.tokenizer, run.trial.evaluation.spec(None),
                     model_name=run.config.model, request_cache=requests)


def evaluate_before_recovery(run: TrialRun) -> dict:
    """The pruned model's perplexity and last zero-shot pass before recovery (`recovery.evaluate_before`), each
    metric under schema.before_recovery_key: what recovery is then measured against, on the evaluation's own
    numbers."""
    evaluation, start, before = run.trial.evaluation, time.perf_counter(), evaluator(run)
    metrics = {}
    if evaluation.ppl is not None:
        metrics["ppl"] = before.perplexity().ppl
    if evaluation.tasks:
        last = len(evaluation.fidelities) - 1
        shots = before.zero_shot(evaluation.fidelities[last], pass_items(run, before, last))
        metrics["acc_mean"] = shots.acc_mean
        for task, entry in shots.tasks.items():
            metrics[schema.task_key(task)] = entry["score"]
            metrics[schema.task_key(task, "_stderr")] = entry["score_stderr"]
            metrics[schema.task_key(task, "_n")] = entry["n"]
    return {schema.before_recovery_key(k): v for k, v in metrics.items()} | {
        schema.seconds_key("before_recovery"): time.perf_counter() - start}


def pass_blocks(fidelities: tuple[int | None, ...], sizes: dict[str, int], seed: int | None) -> Blocks:
    """The blocks of passes at `fidelities` (counts, cheapest first; null = every item) over items of these `sizes`:
    in the model's seeded order (`racing.Blocks`), or in their own order (seed None); a last block of every item, as
    a plan ends."""
    limits = [limit for limit in fidelities if limit is not None]
    cuts = (*limits, limits[-1] + 1)
    if seed is None:
        return Blocks({name: tuple(range(count)) for name, count in sorted(sizes.items())}, cuts)
    return Blocks.plan(sizes, cuts, seed)


def pass_items(run: TrialRun, scorer: Evaluator, index: int) -> dict[str, list[int]] | None:
    """The items the index-th zero-shot pass scores: with `item_seed`, the first N of each task in the model's seeded
    order (`pass_blocks`: the same items for every trial of the model, each pass's a superset of the one before);
    None for lm-eval's first N documents (item_seed null) or every item (a null fidelity)."""
    evaluation = run.trial.evaluation
    if evaluation.item_seed is None or evaluation.fidelities[index] is None:
        return None
    if run.blocks is None:
        run.blocks = pass_blocks(evaluation.fidelities, task_sizes(tuple(evaluation.tasks), scorer.task_data),
                                 race_seed(evaluation.item_seed, run.config.model))
    return run.blocks.items(index)


def start(run: TrialRun) -> dict:
    run.evaluator = evaluator(run)
    return {}


def pass_windows(run: TrialRun, index: int) -> list[int] | None:
    """The windows the index-th perplexity pass scores (`evaluation.ppl_fidelities`): with `item_seed`, the first N
    of the text's windows in the model's seeded order (`pass_blocks`: the same windows for every trial of the model,
    each pass's a superset of the one before); without, the first N; a null fidelity, every window. None for the one
    pass over every window."""
    evaluation = run.trial.evaluation
    if evaluation.ppl_fidelities == (None,):
        return None
    if run.windows is None:
        seed = None if evaluation.item_seed is None else race_seed(evaluation.item_seed, run.config.model)
        run.windows = pass_blocks(evaluation.ppl_fidelities, {"ppl": run.evaluator.ppl_windows()}, seed)
    return run.windows.items(index)["ppl"]


def perplexity_pass(index: int) -> Callable[[TrialRun], dict]:
    """The perplexity pass at the index-th of `ppl_fidelities`: it writes every window scored so far (before its
    report) and reports the perplexity over them, scoring only the windows the pass before lacked."""

    def perplexity(run: TrialRun) -> dict:
        windows = pass_windows(run, index)
        if run.ppl is None:
            result = run.evaluator.perplexity(windows)
        else:
            done = set(run.ppl.ids())
            added = [w for w in windows if w not in done]
            result = run.ppl.adding(run.evaluator.perplexity(added)) if added else run.ppl
        run.ppl = result
        result.write_outcomes(run.trial_dir)  # each window's NLL, before the report
        last = index == len(run.trial.evaluation.ppl_fidelities) - 1
        return result.metrics() | {"stage": "ppl" if last else f"ppl_{len(result.window_nll)}", "ppl_pass": index}

    return perplexity


def zero_shot_pass(index: int) -> Callable[[TrialRun], dict]:
    """The zero-shot pass at the index-th fidelity: each writes its items' outcomes, the last one evaluation.json
    (before its report, so a checkpoint of it can carry the files). On seeded items a pass scores only the items the
    pass before it lacks and reports all of them (`Evaluator.zero_shot_adding`): a trial that reaches the last pass
    pays for each item once."""

    def zero_shot(run: TrialRun) -> dict:
        fidelities = run.trial.evaluation.fidelities
        if run.shots is not None and run.trial.evaluation.item_seed is not None:  # the items the last pass lacked
            shots = run.evaluator.zero_shot_adding(run.shots, fidelities[index], run.blocks.new_items(index))
        else:
            shots = run.evaluator.zero_shot(fidelities[index], pass_items(run, run.evaluator, index))
        run.shots = shots
        shots.write_outcomes(run.trial_dir)  # before the report, so that its checkpoint carries them
        metrics = shots.metrics() | {"zero_shot_pass": index, "stage": shots.stage}
        if run.on_gpu:  # the trial's peak so far; the last report carries the whole trial's (pruning + evaluation)
            metrics["peak_gpu_memory_bytes"] = max(run.peak_gpu_bytes, torch.cuda.max_memory_allocated())
        if run.trial.cache_dir is not None:  # what the shared caches' storage cost, to this point
            metrics |= run.store_stats.metrics()
        if index == len(fidelities) - 1:
            write_json(run.trial_dir / "evaluation.json",
                       {**run.metrics, **metrics, "tasks": shots.tasks, "limit": fidelities[index]})
        return metrics

    return zero_shot
