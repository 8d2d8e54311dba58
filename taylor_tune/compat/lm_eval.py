"""lm-eval 0.4.13's private names: the task YAML loader, the HFLM internals the prefix scorer builds on (it
overrides `_loglikelihood_tokens` and reads the attributes HFLM's own version reads), the environment record
`simple_evaluate` adds to every result, the Jinja prompt templates, and the building of a task's requests (which the
request cache stands in for)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from importlib.metadata import version
from pathlib import Path

import numpy as np

from taylor_tune.compat import missing

TESTED = "0.4.13"
HFLM_METHODS = ("_loglikelihood_tokens", "_model_call")
HFLM_ATTRIBUTES = ("backend", "mixed_precision_dtype", "softmax_dtype", "cache_hook", "rank", "max_length", "device",
                   "tokenizer", "add_bos_token", "prefix_token_id")
ENVIRONMENT_RECORD = ("get_git_commit_hash", "add_env_info")  # names in lm_eval.evaluator
TEMPLATE_NAMES = ("apply_template", "env")  # names in lm_eval.utils
# build_all_requests' arguments in a plain zero-shot pass: what the request cache stands in for, and nothing else
# (fewshot_as_multiturn, True by simple_evaluate's default, acts only with a chat template; `samples`, a list of
# documents to score, is passed on to the build)
PLAIN_BUILD = {"rank": 0, "world_size": 1, "system_instruction": None, "apply_chat_template": False}


def _versions_only(results: dict) -> None:
    results.update(lm_eval_version=version("lm_eval"), transformers_version=version("transformers"))


@contextmanager
def without_environment_record():
    """Inside, `simple_evaluate` records only lm-eval's and transformers' versions with its results. Its own record
    runs `git describe` in the working directory (which prints `fatal: not a git repository` into every trial's log
    outside a checkout, as under `ray job submit --working-dir`) and torch's `collect_env`, which starts a dozen
    processes (pip, nvidia-smi, ...) on every call; nothing here reads either."""
    from lm_eval import evaluator

    saved = {name: getattr(evaluator, name) for name in ENVIRONMENT_RECORD}
    evaluator.get_git_commit_hash, evaluator.add_env_info = (lambda: None), _versions_only
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(evaluator, name, value)


@contextmanager
def compiled_templates() -> Iterator[None]:
    """Inside, lm-eval compiles each Jinja prompt template once. Its `apply_template` compiles the template string
    again for every document and field (`env.from_string`), in building the requests and again in scoring the answers
    (doc_to_choice, doc_to_target): most of a pass's time outside the model. Rendering is unchanged."""
    from lm_eval import utils

    saved = utils.apply_template
    compiled = lru_cache(maxsize=None)(utils.env.from_string)
    utils.apply_template = lambda template, doc: compiled(template).render(**doc)
    try:
        yield
    finally:
        utils.apply_template = saved


@contextmanager
def building_requests(build: Callable) -> Iterator[None]:
    """Inside, a plain zero-shot pass's `Task.build_all_requests(limit=..., samples=...)` (no chat template, no
    system instruction, one process) sets the task's instances to `build(task, limit, lm_eval_build, samples)`, where
    `lm_eval_build()` builds and returns them as lm-eval does. Any other call is lm-eval's own."""
    from lm_eval.api.task import Task

    saved = Task.build_all_requests

    def patched(self, *, limit=None, **arguments):
        def lm_eval_build():
            saved(self, limit=limit, **arguments)
            return self._instances

        if any(arguments.get(name, value) != value for name, value in PLAIN_BUILD.items()) \
                or arguments.get("cache_requests"):
            return saved(self, limit=limit, **arguments)
        listed_documents(self)
        self._instances = build(self, limit, lm_eval_build, arguments.get("samples"))

    Task.build_all_requests = patched
    try:
        yield
    finally:
        Task.build_all_requests = saved


def listed_documents(task) -> None:
    """The task's documents held as a list for the rest of the pass. lm-eval reads them through `eval_docs` three times
    a pass (the request cache's key, building the requests, scoring the answers), each time formatting datasets'
    rows one by one and, for a task with `process_docs` (HellaSwag), running that again; converted once (pyarrow's
    own conversion, the same dicts), the later reads iterate a list."""
    docs = task.eval_docs
    listed = docs.to_list() if hasattr(docs, "to_list") else list(docs)
    setattr(task, "test_docs" if task.has_test_docs() else "validation_docs", lambda: listed)


def as_simple_evaluate_sets(task) -> None:
    """The overrides `simple_evaluate` applies to a loaded task in a plain zero-shot call (no num_fewshot, no
    gen_kwargs, not predict_only): a task that names no num_fewshot gets 0. Its definition (`task_definition`) is
    then the one a pass's requests are keyed by."""
    if task.get_config("num_fewshot") is None:
        task.set_config(key="num_fewshot", value=0)


def task_documents(task, limit: int | None, samples: list[int] | None = None) -> list[tuple[int, dict]]:
    """(doc_id, document) of every document a plain pass at `limit` (or of the listed `samples`) scores, as
    build_all_requests iterates them. With `samples` lm-eval (0.4.13) keeps the listed documents in the task's own
    order and numbers them 0..k-1; its logged samples then carry `samples[k]`, which is the document's index in the
    task only when the list is sorted."""
    return list(task.doc_iterator(rank=0, limit=limit, world_size=1, samples=samples))


def _canonical(value):
    """`value` as the same JSON in every process: a function (at any depth, e.g. in fewshot_config) as its source
    code, never as its repr, which holds its memory address."""
    if isinstance(value, dict):
        return {str(key): _canonical(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(item) for item in value]
    if callable(value):
        try:
            return inspect.getsource(value)
        except (OSError, TypeError):  # a builtin or a C function: its name is all there is
            return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__name__)}"
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return f"{type(value).__module__}.{type(value).__qualname__}"


def task_definition(task) -> dict:
    """A task's configuration (functions as their source code) without its data source: what its requests depend on
    besides the documents, the same in every process."""
    config = _canonical(task.config.to_dict(keep_callable=True))
    for name in ("dataset_path", "dataset_name", "dataset_kwargs", "metadata"):
        config.pop(name, None)
    return config


def encode_requests(lm, instances) -> list[tuple[list[int], list[int]]]:
    """lm-eval's tokenization of each (context, continuation) request, as `TemplateLM.loglikelihood` does it before
    scoring (trailing whitespace moved to the continuation, the prefix token for an empty context): its own code,
    run with the scoring replaced by a recorder. Its tokenizer calls are made in batches (`batched_encode`)."""
    from lm_eval.api.model import TemplateLM

    def run(sink: list) -> None:
        lm._loglikelihood_tokens = lambda requests, **_: sink.extend(requests) or []
        try:
            TemplateLM.loglikelihood(lm, instances, disable_tqdm=True)
        finally:
            del lm._loglikelihood_tokens

    recorded: list = []
    with batched_encode(lm.tokenizer, lambda: run([])):
        run(recorded)
    return [(context, continuation) for _, context, continuation in recorded]


@contextmanager
def rendered_once(task) -> Iterator[None]:
    """Within, the task's `doc_to_choice`, `doc_to_text` and `doc_to_target` render each document once: a check that
    reads a pass's requests and then makes its answer key asks each twice per document (its templates are Jinja)."""
    names = ("doc_to_choice", "doc_to_text", "doc_to_target")
    before = {name: vars(task).get(name, _NONE) for name in names}
    memo: dict[tuple, object] = {}
    kept: list = []  # the documents asked about, alive while their ids key the memo

    def once(name, method):
        def render(doc, *args, **kwargs):
            key = (name, id(doc), args, tuple(sorted(kwargs.items())))
            if key not in memo:
                kept.append(doc)
                memo[key] = method(doc, *args, **kwargs)
            return memo[key]
        return render

    for name in names:
        setattr(task, name, once(name, getattr(task, name)))
    try:
        yield
    finally:
        for name, value in before.items():
            if value is _NONE:
                delattr(task, name)
            else:
                setattr(task, name, value)


# strings a batched encoding is checked on, one at a time, before its answers stand in for the tokenizer's
BATCH_CHECKED = 32


@contextmanager
def batched_encode(tokenizer, dry_run: Callable[[], object]):
    """Within, `tokenizer.encode(text, **kwargs)` answers from one batched call per keyword set: `dry_run` (the code
    that will encode) runs first with `encode` recording what it is asked and answering [], then the recorded texts
    are encoded in a batch (a fast tokenizer's `encode_batch`, all cores) and `encode` answers from that. lm-eval calls
    `tokenizer.encode` once per text (tok_encode), about 140 µs each on this project's CPU for texts of a few
    words; its own logic around the calls runs unchanged. The batch's answers are used only if a sample of
    BATCH_CHECKED texts encoded one at a time gives the same; a text not recorded is encoded as before."""
    import random

    real = tokenizer.encode
    asked: dict[tuple, set[str]] = {}

    def record(text, **kwargs):
        asked.setdefault(tuple(sorted(kwargs.items())), set()).add(text)
        return []

    with _encode_replaced(tokenizer, record):
        dry_run()
    answers: dict[tuple, list[int]] = {}
    for kwargs, texts in asked.items():
        texts = sorted(texts)
        encoded = tokenizer(texts, **dict(kwargs))["input_ids"] if texts else []
        answers |= {(text, kwargs): list(ids) for text, ids in zip(texts, encoded, strict=True)}
    sample = random.Random(0).sample(sorted(answers), min(BATCH_CHECKED, len(answers)))
    if any(real(text, **dict(kwargs)) != answers[(text, kwargs)] for text, kwargs in sample):
        answers = {}  # this tokenizer batches otherwise: every text one at a time, as lm-eval does

    def answer(text, **kwargs):
        found = answers.get((text, tuple(sorted(kwargs.items()))))
        return list(found) if found is not None else real(text, **kwargs)

    with _encode_replaced(tokenizer, answer):
        yield


@contextmanager
def _encode_replaced(tokenizer, encode: Callable) -> Iterator[None]:
    """`tokenizer.encode` is `encode` within (an attribute of the instance, whatever it held before is put back)."""
    before = vars(tokenizer).get("encode", _NONE)
    tokenizer.encode = encode
    try:
        yield
    finally:
        if before is _NONE:
            del tokenizer.encode
        else:
            tokenizer.encode = before


_NONE = object()


# the metrics `evaluation.answers` computes as lm-eval's process_results does for a multiple-choice task
ANSWERED_METRICS = ("acc", "acc_norm")


def answered_metrics(task) -> tuple[str, ...] | None:
    """The metrics of `task` (in its own order) that its items' log-likelihoods decide as lm-eval's
    `ConfigurableTask.process_results` (0.4.13) decides them for a multiple-choice task: acc, the argmax of the
    choices' log-likelihoods, and acc_norm, the argmax of them over each choice's length in characters, each against
    the gold index. None where lm-eval's own scoring is needed: another output type, a task's own process_results,
    several targets, mutual information or any other metric, a filter of its own, repeats."""
    from lm_eval.api.task import ConfigurableTask

    config = task.config
    if not isinstance(task, ConfigurableTask) or task.OUTPUT_TYPE != "multiple_choice" \
            or callable(config.process_results) or task.multiple_target or config.filter_list is not None \
            or (config.repeats or 1) != 1:
        return None
    metrics = tuple(task._metric_fn_list)
    return metrics if metrics and set(metrics) <= set(ANSWERED_METRICS) else None


def gold_index(task, doc: dict, choices: list[str]) -> int | None:
    """The index of `doc`'s gold choice as process_results finds it (from doc_to_text when the choices are in the
    context, as Winogrande's, else from doc_to_target; a string by its place among the choices), -1 where lm-eval
    finds none (no item then scores); None for a gold it reads otherwise (a list: several targets)."""
    gold = task.doc_to_text(doc) if task.multiple_input else task.doc_to_target(doc)
    if isinstance(gold, str):
        return choices.index(gold) if gold in choices else -1
    if isinstance(gold, (int, np.integer)) and not isinstance(gold, bool):
        return int(gold) if 0 <= gold < len(choices) else -1
    return None


def make_instance(request_type: str, doc: dict, arguments: tuple, idx: int, task: str, doc_id: int, repeats: int):
    from lm_eval.api.instance import Instance

    return Instance(request_type=request_type, doc=doc, arguments=arguments, idx=idx,
                    metadata=(task, doc_id, repeats))


def load_task_yaml(path: Path) -> dict:
    """A registered task's YAML with its `!function` entries resolved, as lm-eval's TaskManager reads it."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return dict(load_yaml(path, resolve_func=True))


def check(lm=None) -> None:
    """Raise CompatError if a fenced name is gone; `lm`: an HFLM instance, to check its attributes too."""
    from lm_eval import evaluator, utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.task import Task
    from lm_eval.models.huggingface import HFLM

    gone = [f"HFLM.{name}" for name in HFLM_METHODS if not callable(vars(HFLM).get(name))]  # HFLM's own, not a base's
    gone += [f"lm_eval.evaluator.{name}" for name in ENVIRONMENT_RECORD if not callable(getattr(evaluator, name, None))]
    gone += [f"lm_eval.utils.{name}" for name in TEMPLATE_NAMES if not hasattr(utils, name)]
    methods = ((Task, "build_all_requests"), (Task, "doc_iterator"), (TemplateLM, "loglikelihood"))
    gone += [f"{cls.__name__}.{name}" for cls, name in methods if not callable(getattr(cls, name, None))]
    try:
        from lm_eval.tasks._yaml_loader import load_yaml  # noqa: F401
    except ImportError:
        gone.append("lm_eval.tasks._yaml_loader.load_yaml")
    if lm is not None:
        gone += [f"HFLM().{name}" for name in HFLM_ATTRIBUTES if not hasattr(lm, name)]
    missing("lm-eval", TESTED, gone)
