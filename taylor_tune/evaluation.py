"""Evaluate an in-memory model: perplexity, and the seven zero-shot tasks through lm-eval's `simple_evaluate`.

Perplexity (LLM-Pruner's definition): the text's documents joined with "\\n\\n", tokenized once, cut into
non-overlapping windows of `ppl_window` tokens (the last partial window is dropped); ppl = exp(mean NLL
of every predicted token, i.e. positions 1..W-1 of each window). The window length is reported with it.

Zero-shot: lm-eval's own task definitions (prompts, preprocessing such as HellaSwag's process_docs and
WinoGrande's partial scoring) on the real datasets (`task_data: hub`), or with only their data replaced
by local files of the same schema (the offline world, or a folder). The scorer is lm-eval's HFLM or
`scorer.PrefixLM` (the same log-likelihoods, each shared context forwarded once). `acc_mean` averages one metric per
task, by default as LLM-Pruner reports them: acc for BoolQ, PIQA, WinoGrande, ARC-e; acc_norm for
HellaSwag, ARC-c, OpenBookQA. No model is saved or reloaded: lm-eval's HFLM wraps the model in memory.
"""

from __future__ import annotations

import logging
import math
import time
from functools import lru_cache
from pathlib import Path

import torch

from taylor_tune.calibration import DatasetSource, load_dataset_rows
from taylor_tune.config import EvalSpec
from taylor_tune.errors import EvaluationError
from taylor_tune.progress import bar

log = logging.getLogger(__name__)

WIKITEXT2_TEST = DatasetSource(path="wikitext", name="wikitext-2-raw-v1", split="test")
# Where lm-eval keeps each task's YAML (checked against lm-eval's own index by a test: compat.lm_eval).
TASK_YAML = {
    "boolq": "super_glue/boolq/default.yaml", "piqa": "piqa/piqa.yaml", "hellaswag": "hellaswag/hellaswag.yaml",
    "winogrande": "winogrande/default.yaml", "arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml",
}


# ---------------------------------------------------------------- perplexity

def load_ppl_text(source: str) -> str:
    if source == "wikitext2":
        return "\n\n".join(load_dataset_rows(WIKITEXT2_TEST, what="ppl"))
    if source == "world":
        from taylor_tune.world import heldout_path

        source = str(heldout_path())
    elif source == "wiki":
        from taylor_tune.assets import require

        source = str(require("wiki") / "heldout.txt")
    try:
        return Path(source).read_text(encoding="utf-8")
    except OSError as error:
        raise EvaluationError(f"ppl: cannot read {source}: {error.strerror}") from None


def check_window(window: int, model_config) -> None:
    limit = getattr(model_config, "max_position_embeddings", None)
    if limit is not None and window > limit:
        raise EvaluationError(f"ppl_window: {window} is longer than the model's maximum context of {limit} tokens")


@torch.no_grad()
def perplexity(model, tokenizer, text: str, *, window: int = 128, batch_size: int = 8, max_windows: int | None = None) -> dict:
    """exp(mean token NLL) over non-overlapping windows (the first `max_windows` if given); returns ppl, window,
    windows and tokens scored, and `ppl_curve`: [windows, ppl over those first windows] after each batch (a cheaper
    perplexity's value, for free: what a search could have stopped on)."""
    check_window(window, model.config)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    count = ids.numel() // window
    if count == 0:
        raise EvaluationError(f"ppl: the text has {ids.numel()} tokens, fewer than one window of {window}")
    count = min(count, max_windows or count)
    windows = ids[: count * window].view(count, window)
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64)
    curve = []
    with bar(count * window, "perplexity", unit="tok", unit_scale=True) as progress:
        for start in range(0, count, batch_size):
            batch = windows[start : start + batch_size].to(device)
            logits = model(input_ids=batch, use_cache=False).logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
            )
            total += nll.double().cpu()
            progress.update(batch.numel())
            done = min(start + batch_size, count)
            curve.append([done, math.exp(float(total) / (done * (window - 1)))])
    scored = count * (window - 1)
    return {"ppl": math.exp(float(total) / scored), "ppl_window": window, "ppl_windows": count, "ppl_tokens": scored,
            "ppl_curve": curve}


# ---------------------------------------------------------------- zero-shot through lm-eval

@lru_cache(maxsize=1)
def _lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def offline_task_config(task: str, data_file: Path) -> dict:
    """lm-eval's registered config of `task` with only its data source replaced by a local jsonl file."""
    from taylor_tune.compat.lm_eval import load_task_yaml

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


def write_lm_eval_task(task: str, data_file: Path, folder: Path, name: str | None = None) -> str:
    """A task YAML for lm-eval's own CLI (`--include_path folder --tasks NAME`): lm-eval's registered definition
    of `task` by `include:`, with only its data source replaced, as `offline_task_config` does in memory."""
    import yaml

    name = name or f"{task}_offline"
    source = offline_task_config(task, data_file)
    override = {k: source[k] for k in ("dataset_path", "dataset_name", "dataset_kwargs", "training_split",
                                        "validation_split", "test_split", "fewshot_split")}
    folder.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump({"include": str(_lm_eval_tasks_dir() / TASK_YAML[task]), "task": name, "tag": [], **override})
    (folder / f"{name}.yaml").write_text(text)
    return name


@lru_cache(maxsize=2)
def _task_manager(with_defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=with_defaults)


def resolve_task_data(spec: EvalSpec, model_name: str | None) -> str:
    """auto: the real offline world's tasks for its models, the synthetic world's for the tiny built-ins (and
    pruned folders made from either), else the hub."""
    if spec.task_data != "auto":
        return spec.task_data
    from taylor_tune.models import world_of

    return world_of(model_name) if model_name else "hub"


def task_source(task: str, task_data: str) -> tuple[str | dict, object]:
    """What to pass to simple_evaluate for one task, and the TaskManager that resolves it."""
    if task_data == "hub":
        return task, _task_manager(True)
    if task_data == "world":
        from taylor_tune.world import task_file

        path = task_file(task)
    elif task_data == "real":
        from taylor_tune.assets import require

        path = require("real") / f"{task}.jsonl"
    else:
        path = Path(task_data) / f"{task}.jsonl"
    if not path.is_file():
        raise EvaluationError(f"task {task}: data file {path} is missing")
    return offline_task_config(task, path), _task_manager(False)


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


def _simple_evaluate(lm, spec: EvalSpec, sources: list[tuple[str | dict, object]]) -> dict:
    from lm_eval import simple_evaluate

    return simple_evaluate(
        model=lm, tasks=[source for source, _ in sources], task_manager=sources[0][1], limit=spec.limit,
        bootstrap_iters=1000, log_samples=True, verbosity="ERROR",
    )


def _failure(task: str | None, error: Exception) -> EvaluationError:
    first_line = str(error).splitlines()[0] if str(error) else ""
    return EvaluationError(f"{f'task {task}' if task else 'zero-shot'}: {type(error).__name__}: {first_line}")


def zero_shot(lm, spec: EvalSpec, task_data: str) -> tuple[dict[str, dict], float]:
    """Every task in one `simple_evaluate` call: lm-eval then pools the requests of all tasks into one sorted
    batch stream, and pays its per-call set-up once, not per task (it collects the environment by running pip,
    0.3-0.5 s here). A pass's time is reported as a whole: per-task times do not exist in one call."""
    sources = {task: task_source(task, task_data) for task in spec.tasks}
    start = time.perf_counter()
    try:
        result = _simple_evaluate(lm, spec, list(sources.values()))
    except torch.cuda.OutOfMemoryError as error:  # the model's, not a task's: running tasks alone would only repeat it
        raise _failure(None, error) from None
    except Exception as error:  # lm-eval and datasets raise anything: find the task it came from by running each alone
        for task, source in sources.items():
            try:
                _simple_evaluate(lm, spec, [source])
            except Exception as task_error:
                raise _failure(task, task_error) from None
        raise _failure(None, error) from None
    seconds = time.perf_counter() - start
    # lm-eval keys results by the task's own name: the hub task's, or the offline config's
    names = {task: source if isinstance(source, str) else source["task"] for task, (source, _) in sources.items()}
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
    return out, seconds


def make_lm(model, tokenizer, batch_size: int | str, scorer: str = "prefix"):
    from taylor_tune.scorer import make_lm as make

    return make(model, tokenizer, batch_size, scorer)


def evaluate(model, tokenizer, spec: EvalSpec, *, model_name: str | None = None) -> dict:
    """Perplexity and zero-shot results of the in-memory `model`, as one flat-plus-nested dict."""
    if spec.ppl is not None:
        check_window(spec.ppl_window, model.config)
    was_training = model.training
    model.eval()
    try:
        result: dict = {}
        if spec.ppl is not None:
            from taylor_tune.models import resolve_text

            start = time.perf_counter()
            source = resolve_text(spec.ppl, model_name)
            result |= perplexity(model, tokenizer, load_ppl_text(source), window=spec.ppl_window,
                                 max_windows=spec.ppl_max_windows)
            result["ppl_source"] = source
            result["ppl_seconds"] = time.perf_counter() - start
        if spec.tasks:
            task_data = resolve_task_data(spec, model_name)
            lm = make_lm(model, tokenizer, spec.batch_size, spec.scorer)
            tasks, seconds = zero_shot(lm, spec, task_data)
            result["task_data"] = task_data
            result["scorer"], result["zero_shot_tokens"] = spec.scorer, lm.tokens_forwarded
            result["tasks"] = tasks
            result["zero_shot_seconds"] = seconds
            result["zero_shot_items_per_s"] = sum(e["n"] for e in tasks.values()) / seconds if seconds > 0 else None
            for task, entry in tasks.items():
                result[f"acc_{task}"] = entry["score"]
            result["acc_mean"] = sum(e["score"] for e in tasks.values()) / len(tasks)
        return result
    finally:
        model.train(was_training)
