"""Zero-shot accuracy through lm-eval's `simple_evaluate`, on an in-memory model wrapped by a scorer.

lm-eval's own task definitions (prompts, preprocessing such as HellaSwag's process_docs and WinoGrande's partial
scoring) on the real datasets (`task_data: hub`), or with only their data replaced by local files of the same
schema (the offline worlds, or a folder; `sources.data.task_file` says which file). `acc_mean` averages one metric
per task, by default as LLM-Pruner reports them: acc for BoolQ, PIQA, WinoGrande, ARC-e; acc_norm for HellaSwag,
ARC-c, OpenBookQA. No model is saved or reloaded.
"""

from __future__ import annotations

import logging
import math
import time
from functools import lru_cache
from pathlib import Path

import lm_eval.tasks
import pandas as pd
import torch
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager, get_task_dict

from taylor_tune.compat.lm_eval import (
    as_simple_evaluate_sets,
    building_requests,
    compiled_templates,
    listed_documents,
    load_task_yaml,
    without_environment_record,
)
from taylor_tune.config import EvalSpec
from taylor_tune.errors import EvaluationError
from taylor_tune.evaluation.answers import AnswerKey
from taylor_tune.evaluation.requests import PassRequests
from taylor_tune.sources.data import task_file
from taylor_tune.storage.names import OUTCOME_COLUMNS

log = logging.getLogger(__name__)

# Where lm-eval keeps each task's YAML (checked against lm-eval's own index by a test).
TASK_YAML = {
    "boolq": "super_glue/boolq/default.yaml", "piqa": "piqa/piqa.yaml", "hellaswag": "hellaswag/hellaswag.yaml",
    "winogrande": "winogrande/default.yaml", "arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml",
}


@lru_cache(maxsize=1)
def _lm_eval_tasks_dir() -> Path:
    return Path(lm_eval.tasks.__file__).parent


def offline_task_config(task: str, data_file: Path) -> dict:
    """lm-eval's registered config of `task` with only its data source replaced by a local jsonl file."""
    config = load_task_yaml(_lm_eval_tasks_dir() / TASK_YAML[task])
    split = "test" if config.get("test_split") else "validation"
    config.pop("tag", None)
    config.update(
        task=f"{task}_offline", dataset_path="json", dataset_name=None,
        dataset_kwargs={"data_files": {split: str(Path(data_file).resolve())}},
        training_split=None, validation_split="validation" if split == "validation" else None,
        test_split="test" if split == "test" else None, fewshot_split=None,
    )
    return config


@lru_cache(maxsize=2)
def _task_manager(with_defaults: bool):
    return TaskManager(include_defaults=with_defaults)


def task_source(task: str, task_data: str) -> tuple[str | dict, object]:
    """What to pass to simple_evaluate for one task, and the TaskManager that resolves it."""
    path = task_file(task, task_data)
    if path is None:
        return task, _task_manager(True)
    return offline_task_config(task, path), _task_manager(False)


def task_sizes(tasks: tuple[str, ...], task_data: str) -> dict[str, int]:
    """Each task's item count (the documents of the split it is scored on): what a race's blocks are drawn from."""
    return dict(_task_sizes(tuple(tasks), task_data))


@lru_cache(maxsize=4)  # a sweep's trials in one worker ask for the same tasks
def _task_sizes(tasks: tuple[str, ...], task_data: str) -> tuple[tuple[str, int], ...]:
    return tuple((task, len(built_task(task, task_data).eval_docs)) for task in tasks)


@lru_cache(maxsize=16)
def built_task(task: str, task_data: str):
    """lm-eval's task object of `task` on `task_data`, built once per worker (a sweep reuses its workers): what the
    answer keys' fields are found from. Never scored through: lm-eval's own passes build their own."""
    source, manager = task_source(task, task_data)
    (loaded,) = get_task_dict([source], manager).values()
    as_simple_evaluate_sets(loaded)
    listed_documents(loaded)
    return loaded


def result_name(source: str | dict) -> str:
    """The name lm-eval keys a task's results by: the hub task's own, or the offline config's."""
    return source if isinstance(source, str) else source["task"]


def _metric(results: dict, name: str) -> float | None:
    value = results.get(f"{name},none")
    return None if value in (None, "N/A") else float(value)


def split_scores(samples: list[dict], metric: str) -> dict:
    """The task's score on its even-numbered items ("sel") and on its odd-numbered ones ("heldout"), so that a
    report can choose a configuration on one half and report it on the other, untouched half."""
    halves: dict[str, list[float]] = {"sel": [], "heldout": []}
    for sample in samples:
        halves["sel" if sample["doc_id"] % 2 == 0 else "heldout"].append(float(sample[metric]))
    out = {}
    for half, values in halves.items():
        out[f"score_{half}"] = sum(values) / len(values) if values else None
        out[f"n_{half}"] = len(values)
    return out


def task_results(outcomes: pd.DataFrame, spec: EvalSpec) -> dict[str, dict]:
    """Each task's entry of a pass (as `zero_shot` returns them) computed from its items' outcomes, as lm-eval
    aggregates them (the mean, and `mean_stderr`: the sample standard deviation over sqrt(n)): what a pass that
    adds items to an earlier pass's reports for all of them."""
    out = {}
    for task in spec.tasks:
        items = outcomes[outcomes["task"] == task].sort_values("doc_id")
        entry: dict = {"metric": spec.metric(task), "n": len(items)}
        for name in ("acc", "acc_norm"):
            values = items[name].tolist()
            known = bool(values) and not any(math.isnan(v) for v in values)
            mean = sum(values) / len(values) if known else None
            entry[name] = mean
            entry[f"{name}_stderr"] = (math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
                                       / math.sqrt(len(values))) if known and len(values) > 1 else None
        if entry[entry["metric"]] is None:
            raise EvaluationError(f"task {task}: no {entry['metric']} among its items' outcomes")
        entry["score"], entry["score_stderr"] = entry[entry["metric"]], entry[f"{entry['metric']}_stderr"]
        entry |= split_scores([{"doc_id": d, entry["metric"]: v} for d, v in zip(items["doc_id"],
                                                                                items[entry["metric"]])],
                              entry["metric"])
        out[task] = entry
    return out


def item_outcomes(samples: dict[str, list[dict]]) -> pd.DataFrame:
    """Each item's outcome from lm-eval's logged samples, {task: samples}: task, doc_id, acc and acc_norm (NaN where
    the task has no acc_norm), in the order of `names.OUTCOME_COLUMNS`."""
    rows = [(task, sample["doc_id"], float(sample["acc"]), float(sample.get("acc_norm", math.nan)))
            for task, task_samples in samples.items() for sample in task_samples]
    frame = pd.DataFrame(rows, columns=list(OUTCOME_COLUMNS))
    return frame.astype({"doc_id": "int64", "acc": "float64", "acc_norm": "float64"})


def _simple_evaluate(lm, spec: EvalSpec, sources: list[tuple[str | dict, object]], requests: PassRequests,
                     samples: dict[str, list[int]] | None = None) -> dict:
    with without_environment_record(), compiled_templates(), building_requests(requests), requests.scoring():
        return simple_evaluate(
            model=lm, tasks=[source for source, _ in sources], task_manager=sources[0][1],
            limit=spec.limit if samples is None else None, samples=samples,
            bootstrap_iters=1000, log_samples=True, verbosity="ERROR",
        )


def _failure(task: str | None, error: Exception) -> EvaluationError:
    first_line = str(error).splitlines()[0] if str(error) else ""
    return EvaluationError(f"{f'task {task}' if task else 'zero-shot'}: {type(error).__name__}: {first_line}")


def answered(lm, keys: dict[str, AnswerKey]) -> pd.DataFrame:
    """Every item's outcome of the tasks whose answer keys are at hand (task -> key): their requests scored in one
    call of the scorer, as lm-eval pools a pass's requests, then each item's acc and acc_norm from its choices'
    log-likelihoods (`AnswerKey.outcomes`)."""
    requests = [request for key in keys.values() for request in key.requests()]
    scores = [score for score, _ in lm._loglikelihood_tokens(requests, disable_tqdm=True)]
    parts, start = [], 0
    for task, key in keys.items():
        parts.append(key.outcomes(task, scores[start : start + len(key.idx)]))
        start += len(key.idx)
    return pd.concat(parts, ignore_index=True)


def zero_shot(lm, spec: EvalSpec, task_data: str, requests: PassRequests | None = None,
              samples: dict[str, list[int]] | None = None) -> tuple[dict[str, dict], float, pd.DataFrame]:
    """Every task in one pass. A task whose answer key a sweep's earlier pass kept (`evaluation.answers`: with a
    request cache and the prefix scorer) is scored without lm-eval: its requests go to the scorer and its outcomes are
    computed from the answers as lm-eval computes them. The others go through lm-eval's `simple_evaluate` in one call
    (`lm_eval_pass`), which keeps their keys for the next pass. Each task's entry is lm-eval's when lm-eval scored the
    whole pass, else aggregated from the items' outcomes as lm-eval aggregates them (`task_results`).
    Returns the tasks' results, the pass's seconds and every item's outcome (`item_outcomes`)."""
    requests = PassRequests(lm) if requests is None else requests
    start = time.perf_counter()
    keys = requests.answer_keys({task: built_task(task, task_data) for task in spec.tasks},
                                spec.limit if samples is None else None,
                                None if samples is None else {task: sorted(set(samples[task])) for task in spec.tasks}
                                ) if requests.answering else {}
    rest = [task for task in spec.tasks if task not in keys]
    if not keys:
        return lm_eval_pass(lm, spec, task_data, requests, samples)
    try:
        outcomes = answered(lm, keys)
    except Exception as error:  # the model's (out of memory, a shape): no task to name
        raise _failure(None, error) from None
    if rest:
        _, _, more = lm_eval_pass(lm, spec.model_copy(update={"tasks": tuple(rest)}), task_data, requests,
                                  None if samples is None else {task: samples[task] for task in rest})
        outcomes = pd.concat([outcomes, more], ignore_index=True)
    order = {task: n for n, task in enumerate(spec.tasks)}
    outcomes = outcomes.sort_values(["task", "doc_id"], key=lambda c: c.map(order) if c.name == "task" else c,
                                    kind="stable", ignore_index=True)
    seconds = time.perf_counter() - start
    out = task_results(outcomes, spec)
    log.info("zero-shot: %d tasks (%d from answer keys), %d items in %.1fs", len(out), len(keys),
             sum(e["n"] for e in out.values()), seconds)
    return out, seconds, outcomes


def lm_eval_pass(lm, spec: EvalSpec, task_data: str, requests: PassRequests,
                 samples: dict[str, list[int]] | None = None) -> tuple[dict[str, dict], float, pd.DataFrame]:
    """Every task in one `simple_evaluate` call: lm-eval then pools the requests of all tasks into one sorted
    batch stream, and pays its per-call set-up once, not per task (it collects the environment by running pip).
    A pass's time is reported as a whole: per-task times do not exist in one call. `requests` builds the pass's
    requests (with a cache, read from it) and counts their time; default: built and tokenized once, no cache.
    `samples` (task -> the indices of its items to score, instead of the spec's limit) scores chosen items, as a
    race's blocks do; their outcomes keep each item's index in its task.
    Returns the tasks' results, the pass's seconds and every item's outcome (`item_outcomes`)."""
    sources = {task: task_source(task, task_data) for task in spec.tasks}
    # sorted: lm-eval numbers the listed items 0..k-1 in the task's order and logs each under `list[k]`, the index
    # in the task only when the list is in that order (`compat.lm_eval.task_documents`)
    listed = None if samples is None else {result_name(sources[task][0]): sorted(set(samples[task]))
                                           for task in spec.tasks}
    start = time.perf_counter()
    try:
        result = _simple_evaluate(lm, spec, list(sources.values()), requests, listed)
    except torch.cuda.OutOfMemoryError as error:  # the model's, not a task's: running tasks alone would only repeat it
        raise _failure(None, error) from None
    except Exception as error:  # lm-eval and datasets raise anything: find the task it came from by running each alone
        for task, source in sources.items():
            try:
                _simple_evaluate(lm, spec, [source], PassRequests(lm),
                                 None if listed is None else {result_name(source): listed[result_name(source)]})
            except Exception as task_error:
                raise _failure(task, task_error) from None
        raise _failure(None, error) from None
    seconds = time.perf_counter() - start
    names = {task: result_name(source) for task, (source, _) in sources.items()}
    out = {}
    for task, name in names.items():
        raw = result["results"][name]
        metric = spec.metric(task)
        entry = {
            "acc": _metric(raw, "acc"), "acc_stderr": _metric(raw, "acc_stderr"),
            "acc_norm": _metric(raw, "acc_norm"), "acc_norm_stderr": _metric(raw, "acc_norm_stderr"),
            "metric": metric, "n": int(raw.get("sample_len") or result["n-samples"][name]["effective"]),
        }
        if entry[metric] is None:
            raise EvaluationError(f"task {task}: lm-eval reported no {metric}")
        entry["score"], entry["score_stderr"] = entry[metric], entry[f"{metric}_stderr"]
        entry |= split_scores(result["samples"][name], metric)
        out[task] = entry
        log.info("%s: %s %.4f (n=%d)", task, metric, entry["score"], entry["n"])
    log.info("zero-shot: %d tasks, %d items in %.1fs", len(out), sum(e["n"] for e in out.values()), seconds)
    outcomes = item_outcomes({task: result["samples"][name] for task, name in names.items()})
    if requests.made:
        requests.keep_answer_keys({names[task]: outcomes[outcomes["task"] == task] for task in names})
    return out, seconds, outcomes
