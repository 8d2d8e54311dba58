"""The one evaluation path: perplexity, then zero-shot passes, each returning a typed result that flattens into the
metrics a trial reports and `taylor-tune evaluate` writes.

`Evaluator` is set up once per model (its window checked, its scorer built, its data names resolved) and runs
each stage when asked, so a sweep's trial can report between stages and run several zero-shot passes at
increasing item limits with one scorer; `evaluate` runs them all at once. The model is put in eval mode for the
duration and given back in the mode it came in.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from taylor_tune import schema
from taylor_tune.config import PPL_BATCH, EvalSpec
from taylor_tune.evaluation.perplexity import check_window, curve_of, perplexity, windows_of
from taylor_tune.evaluation.requests import PassRequests, RequestCache
from taylor_tune.evaluation.scorer import make_lm
from taylor_tune.evaluation.zero_shot import task_results, zero_shot
from taylor_tune.jsonio import write_bytes
from taylor_tune.sources.data import load_ppl_text, resolve_task_data, resolve_text
from taylor_tune.storage import names


def _write_parquet(frame: pd.DataFrame, path: Path) -> Path:
    """`frame` as a parquet file (plain columns, nothing pickled), written whole or not at all (`write_bytes`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), buffer)
    return write_bytes(path, buffer.getvalue().to_pybytes())


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    window: int
    windows: int
    tokens: int
    curve: list  # [windows, ppl over those first windows] after each batch
    source: str  # the text, resolved (never auto)
    seconds: float
    window_nll: list = field(default_factory=list, compare=False, repr=False)  # each window's summed NLL
    window_ids: list | None = field(default=None, compare=False, repr=False)  # which windows; None: 0, 1, ...

    def adding(self, added: PerplexityResult) -> PerplexityResult:
        """This pass's windows and `added`'s (other windows of the same text, window and model) as one result: the
        perplexity over all of them, their curve in this order; the seconds are the added pass's."""
        nll, ids = [*self.window_nll, *added.window_nll], [*self.ids(), *added.ids()]
        tokens = len(nll) * (self.window - 1)
        return PerplexityResult(math.exp(math.fsum(nll) / tokens), self.window, len(nll), tokens,
                                curve_of(nll, self.window, PPL_BATCH), self.source, added.seconds, nll, ids)

    def ids(self) -> list[int]:
        return list(range(len(self.window_nll))) if self.window_ids is None else list(self.window_ids)

    def write_outcomes(self, folder: Path) -> Path:
        """Each window's summed NLL and its predicted tokens as `names.PPL_WINDOWS_FILE` in `folder` (parquet),
        written whole or not at all."""
        frame = pd.DataFrame({"window": self.ids(), "nll": self.window_nll, "tokens": self.window - 1})
        return _write_parquet(frame, Path(folder) / names.PPL_WINDOWS_FILE)

    def metrics(self) -> dict:
        return {"ppl": self.ppl, "ppl_window": self.window, "ppl_windows": self.windows, "ppl_tokens": self.tokens,
                "ppl_curve": self.curve, "ppl_source": self.source, schema.seconds_key("ppl"): self.seconds}


@dataclass(frozen=True)
class ZeroShotResult:
    tasks: dict[str, dict]  # per task: acc, acc_norm (+ stderr), metric, score, score_stderr, n, the halves' scores
    limit: int | None  # items per task; None = every item
    task_data: str  # resolved (never auto)
    scorer: str
    tokens: int  # positions forwarded by this pass, padding included
    seconds: float
    requests_seconds: float  # of `seconds`: building (or reading) and tokenizing the requests
    requests_built: int  # tasks whose requests this pass built (the others': read from the request cache)
    outcomes: pd.DataFrame | None = field(default=None, compare=False, repr=False)  # every item's (item_outcomes)

    @property
    def stage(self) -> str:
        return schema.zero_shot_stage(self.limit)

    @property
    def acc_mean(self) -> float:
        return sum(e["score"] for e in self.tasks.values()) / len(self.tasks)

    def write_outcomes(self, folder: Path) -> Path:
        """Every item's outcome as `names.outcomes_file(stage)` in `folder` (parquet: plain columns, nothing pickled),
        written whole or not at all."""
        return _write_parquet(self.outcomes, Path(folder) / names.outcomes_file(self.stage))

    def metrics(self) -> dict:
        out: dict = {}
        for task, entry in self.tasks.items():
            out[schema.task_key(task)] = entry["score"]
            out[schema.task_key(task, "_stderr")] = entry["score_stderr"]
            out[schema.task_key(task, "_n")] = entry["n"]  # items scored: the report's Wilson intervals
            for half in ("sel", "heldout"):
                out[schema.task_key(task, f"_{half}")] = entry[f"score_{half}"]
        return out | {"acc_mean": self.acc_mean, "fidelity": self.limit or 0, "task_data": self.task_data,
                      "scorer": self.scorer, schema.seconds_key(self.stage): self.seconds,
                      schema.requests_key(self.stage): self.requests_seconds,
                      schema.requests_key(self.stage, "_built"): self.requests_built,
                      schema.tokens_key(self.stage): self.tokens}


@contextmanager
def _eval_mode(model):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class Evaluator:
    """Evaluates one in-memory model as `spec` says; `model_name` is what `auto` data names resolve against;
    `request_cache`: where zero-shot requests built once are kept for every later pass (a sweep's trials)."""

    def __init__(self, model, tokenizer, spec: EvalSpec, *, model_name: str | None = None,
                 request_cache: RequestCache | None = None):
        if spec.ppl is not None:
            check_window(spec.ppl_window, model.config)
        self.model, self.tokenizer, self.spec, self.model_name = model, tokenizer, spec, model_name
        self.request_cache = request_cache
        self.task_data = resolve_task_data(spec.task_data, model_name)
        self.ppl_source = None if spec.ppl is None else resolve_text(spec.ppl, model_name)  # names resolved once
        self._lm = None

    def perplexity(self, select: list[int] | None = None) -> PerplexityResult:
        """Perplexity over the text's windows (the spec's window and max_windows), or over those `select` lists."""
        spec, source = self.spec, self.ppl_source
        start = time.perf_counter()
        with _eval_mode(self.model):
            out = perplexity(self.model, self.tokenizer, load_ppl_text(source), window=spec.ppl_window,
                             batch_size=PPL_BATCH, max_windows=spec.ppl_max_windows, select=select)
        return PerplexityResult(out["ppl"], out["ppl_window"], out["ppl_windows"], out["ppl_tokens"], out["ppl_curve"],
                                source, time.perf_counter() - start, out["window_nll"], out["window_ids"])

    def ppl_windows(self) -> int:
        """How many windows `perplexity` scores in all."""
        return len(windows_of(self.tokenizer, load_ppl_text(self.ppl_source), self.spec.ppl_window,
                              self.spec.ppl_max_windows))

    @property
    def lm(self):
        """The lm-eval scorer of the zero-shot passes, made on first use and kept for the later passes."""
        if self._lm is None:
            self._lm = make_lm(self.model, self.tokenizer, self.spec.batch_size, self.spec.scorer,
                               self.spec.fused)
        return self._lm

    def zero_shot(self, limit: int | None, samples: dict[str, list[int]] | None = None) -> ZeroShotResult:
        """One pass over the spec's tasks at `limit` items per task (the spec's own limit is not used): lm-eval's
        first `limit` documents, or the listed `samples` (task -> item indices; `limit` then names the pass)."""
        tasks, *counted, outcomes = self._pass(self.spec.model_copy(update={"limit": limit}), samples)
        return ZeroShotResult(tasks, limit, self.task_data, self.spec.scorer, *counted, outcomes)

    def zero_shot_adding(self, previous: ZeroShotResult, limit: int | None,
                         added: dict[str, list[int]]) -> ZeroShotResult:
        """The pass at `limit` that scores only the `added` items (task -> indices `previous` did not score) and
        reports every item of both, from their outcomes (`task_results`): what one pass over all of them reports,
        for the added items' cost. Its seconds, tokens and requests are the added items'."""
        tasks = [task for task in self.spec.tasks if added.get(task)]
        if not tasks:  # every task's items were all scored already
            return dataclasses.replace(previous, limit=limit, tokens=0, seconds=0.0, requests_seconds=0.0,
                                       requests_built=0)
        spec = self.spec.model_copy(update={"tasks": tuple(tasks), "limit": limit})
        _, *counted, outcomes = self._pass(spec, {task: added[task] for task in tasks})
        outcomes = pd.concat([previous.outcomes, outcomes], ignore_index=True)
        return ZeroShotResult(task_results(outcomes, self.spec), limit, self.task_data, self.spec.scorer, *counted,
                              outcomes)

    def _pass(self, spec: EvalSpec, samples: dict[str, list[int]] | None) -> tuple:
        """One lm-eval pass: (tasks, tokens forwarded, seconds, requests' seconds, requests built, outcomes)."""
        lm = self.lm
        before = lm.tokens_forwarded
        requests = PassRequests(lm, self.request_cache)
        with _eval_mode(self.model):
            tasks, seconds, outcomes = zero_shot(lm, spec, self.task_data, requests, samples)
        return tasks, lm.tokens_forwarded - before, seconds, requests.seconds, requests.built, outcomes


def flatten(ppl: PerplexityResult | None, shots: ZeroShotResult | None) -> dict:
    """The flat metrics of an evaluation (what a trial reports), plus `tasks`: the per-task details."""
    out = ppl.metrics() if ppl is not None else {}
    if shots is not None:
        out |= shots.metrics() | {"tasks": shots.tasks}
    return out


def evaluate(model, tokenizer, spec: EvalSpec, *, model_name: str | None = None) -> dict:
    """Perplexity (if `spec.ppl`) and one zero-shot pass at `spec.limit` (if `spec.tasks`) of the in-memory model,
    flattened (`flatten`)."""
    evaluator = Evaluator(model, tokenizer, spec, model_name=model_name)
    ppl = evaluator.perplexity() if spec.ppl is not None else None
    shots = evaluator.zero_shot(spec.limit) if spec.tasks else None
    return flatten(ppl, shots)
