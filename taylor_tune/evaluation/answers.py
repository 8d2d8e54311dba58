"""Answer keys: what a later pass over a task's items needs besides the model, so that it scores without lm-eval.

In a sweep every trial of a model asks the same questions; only the answers differ. lm-eval's pass spends most of its
host time around the answers: building the tasks (a pass over the documents), building or reading the requests,
and after the scoring `process_results` per item (Jinja targets again), logging and hashing every document. On a GPU
the device waits through all of it. An `AnswerKey` holds, per request of one task's pass, what lm-eval's own
scoring of a multiple-choice item reads (`compat.lm_eval.answered_metrics`): the item, the choice's index, whether it
is the gold one, the choice's length in characters, and the tokens lm-eval scores. A later pass hands the tokens to
the scorer and computes acc and acc_norm from the log-likelihoods as `process_results` does (`outcomes`); the
task's entry is then aggregated from the outcomes as lm-eval aggregates them (`zero_shot.task_results`).

A key is made in a pass that runs through lm-eval, from the very requests lm-eval scores, and is stored only after
its outcomes, computed from that pass's own log-likelihoods, equal lm-eval's for every item (`verified`). It is kept
in the sweep's request cache under the fields of the pass's request entry, as one header line (the fields, the
metrics, the sha256 of the payload) and an Arrow IPC stream: columns of numbers, nothing that runs code when read.
Each worker keeps the keys it has read (a sweep reuses its workers), and the tasks it built to find them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd

from taylor_tune.compat.lm_eval import answered_metrics, gold_index
from taylor_tune.jsonio import checked_bytes, checked_payload
from taylor_tune.storage.names import OUTCOME_COLUMNS

PART = "answer key"
KEPT = 64  # keys a worker keeps in memory (a race's blocks each have their own)
COLUMNS = ("doc_id", "idx", "gold", "chars")  # and the tokens: context, continuation


@dataclass(frozen=True)
class AnswerKey:
    """One task's pass: per request (sorted by item, then choice) the item's doc_id as lm-eval reports it, the
    choice's index, whether it is the gold choice, its length in characters, and lm-eval's tokens of the request;
    `metrics`: what `outcomes` reports (the task's own of acc and acc_norm)."""

    task: str
    metrics: tuple[str, ...]
    doc_id: np.ndarray
    idx: np.ndarray
    gold: np.ndarray
    chars: np.ndarray
    contexts: list[list[int]]
    continuations: list[list[int]]

    @classmethod
    def of(cls, task, instances: list, tokens: list[tuple[list[int], list[int]]],
           samples: list[int] | None) -> tuple[AnswerKey, list] | None:
        """The key of `task`'s pass from the requests lm-eval built for it and their tokens, and the instances in the
        key's order; None for a task whose metrics lm-eval alone computes, or a gold it reads otherwise. `samples`:
        the listed items (sorted), which lm-eval numbers 0..k-1 and reports by their index in the task."""
        metrics = answered_metrics(task)
        if metrics is None or not instances:
            return None
        rows, per_doc = [], {}
        for instance, (context, continuation) in zip(instances, tokens, strict=True):
            if instance.doc_id not in per_doc:
                choices = task.doc_to_choice(instance.doc)
                per_doc[instance.doc_id] = (choices, gold_index(task, instance.doc, choices))
            choices, gold = per_doc[instance.doc_id]
            if gold is None or instance.repeats != 1:
                return None
            reported = samples[instance.doc_id] if samples else instance.doc_id
            rows.append((reported, instance.idx, instance.idx == gold, float(len(choices[instance.idx])),
                         list(context), list(continuation), instance))
        rows.sort(key=lambda row: (row[0], row[1]))
        doc_id, idx, gold, chars, contexts, continuations, ordered = zip(*rows)
        key = cls(task.config.task, metrics, np.array(doc_id, dtype=np.int64), np.array(idx, dtype=np.int32),
                  np.array(gold, dtype=bool), np.array(chars, dtype=np.float64), list(contexts), list(continuations))
        return key, list(ordered)

    def same(self, other: AnswerKey) -> bool:
        """Whether two keys say the same of every request (every field, exactly)."""
        arrays = ("doc_id", "idx", "gold", "chars")
        return (self.task, self.metrics, self.contexts, self.continuations) == (
            other.task, other.metrics, other.contexts, other.continuations) and all(
            np.array_equal(getattr(self, name), getattr(other, name)) for name in arrays)

    def requests(self) -> list[tuple[None, list[int], list[int]]]:
        """The requests as a scorer's `_loglikelihood_tokens` takes them (no string key: nothing to cache by)."""
        return [(None, context, continuation) for context, continuation in zip(self.contexts, self.continuations)]

    def outcomes(self, task: str, loglikelihoods) -> pd.DataFrame:
        """Each item's acc and acc_norm (NaN where the task has no acc_norm) from its choices' log-likelihoods (in
        the key's order), as lm-eval's process_results computes them: np.argmax (the first of equal maxima) of the
        log-likelihoods, and of them divided by each choice's length in characters, compared with the gold index.
        Columns as `zero_shot.item_outcomes`, rows by doc_id. A choice missing from an item is never chosen."""
        docs, position = np.unique(self.doc_id, return_inverse=True)
        lls = np.full((len(docs), int(self.idx.max(initial=-1)) + 1), -np.inf)
        lls[position, self.idx] = np.asarray(loglikelihoods, dtype=np.float64)
        lengths = np.ones(lls.shape)
        lengths[position, self.idx] = self.chars
        golds = np.zeros(lls.shape, dtype=bool)
        golds[position, self.idx] = self.gold
        rows = np.arange(len(docs))
        acc = golds[rows, np.argmax(lls, axis=1)].astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):  # a choice of no characters: lm-eval's own inf or nan
            norm = golds[rows, np.argmax(lls / lengths, axis=1)].astype(np.float64)
        frame = pd.DataFrame({"task": task, "doc_id": docs, "acc": acc,
                              "acc_norm": norm if "acc_norm" in self.metrics else np.nan})
        return frame[list(OUTCOME_COLUMNS)].astype({"doc_id": "int64", "acc": "float64", "acc_norm": "float64"})

    def to_bytes(self, fields: dict) -> bytes:
        """One header line (fields, part, metrics, the payload's sha256), then the key as an Arrow IPC stream."""
        import pyarrow as pa

        tokens = max((max(t, default=0) for t in (*self.contexts, *self.continuations)), default=0)
        if tokens >= 2**31:
            raise ValueError(f"{self.task}: a token id {tokens} does not fit the key's int32 columns")
        table = pa.table([self.doc_id, self.idx, self.gold, self.chars, pa.array(self.contexts, pa.list_(pa.int32())),
                          pa.array(self.continuations, pa.list_(pa.int32()))], schema=_schema())
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return checked_bytes(fields, PART, sink.getvalue().to_pybytes(), task=self.task, metrics=list(self.metrics))

    @classmethod
    def from_bytes(cls, data: bytes, fields: dict) -> AnswerKey:
        """The key stored by `to_bytes` for these `fields`; ValueError when it is another's, cut short or changed,
        or does not hold a key (each item's choices 0..k-1, at most one gold)."""
        import pyarrow as pa

        header, payload = checked_payload(data, fields, PART)
        metrics = header.get("metrics")
        if not (isinstance(metrics, list) and metrics and all(m in ("acc", "acc_norm") for m in metrics)):
            raise ValueError(f"its metrics {metrics!r} are not among acc and acc_norm")
        table = pa.ipc.open_stream(payload).read_all()
        if table.schema != _schema():
            raise ValueError(f"its columns are {table.schema}, not a key's")
        columns = {name: table.column(name).to_numpy() for name in COLUMNS}
        key = cls(str(header.get("task")), tuple(metrics), *columns.values(), *(
            _lists(table.column(name)) for name in ("context", "continuation")))
        key.check()
        return key

    def check(self) -> None:
        """ValueError unless each item's requests are its choices 0..k-1 in order, with at most one gold."""
        n = len(self.doc_id)
        if not (len(self.idx) == len(self.gold) == len(self.chars) == len(self.contexts) == len(self.continuations)
                == n) or n == 0:
            raise ValueError("its columns are empty or of unequal lengths")
        first = np.r_[True, self.doc_id[1:] != self.doc_id[:-1]]
        if np.any(self.doc_id[1:] < self.doc_id[:-1]):
            raise ValueError("its items are not in order")
        expected = np.arange(n) - np.maximum.accumulate(np.where(first, np.arange(n), 0))
        if not np.array_equal(self.idx, expected):
            raise ValueError("an item's requests are not its choices 0..k-1 in order")
        starts = np.flatnonzero(first)
        if np.any(np.add.reduceat(self.gold.astype(np.int64), starts) > 1):
            raise ValueError("an item has more than one gold choice")
        if any(not c for c in self.continuations):
            raise ValueError("a request has no continuation tokens")


def _schema():
    import pyarrow as pa

    return pa.schema([("doc_id", pa.int64()), ("idx", pa.int32()), ("gold", pa.bool_()), ("chars", pa.float64()),
                      ("context", pa.list_(pa.int32())), ("continuation", pa.list_(pa.int32()))])


def _lists(column) -> list[list[int]]:
    """An Arrow list<int32> column as Python lists (one conversion of the flat values, then slices)."""
    array = column.combine_chunks()
    flat, offsets = array.values.to_numpy().tolist(), array.offsets.to_numpy()
    return [flat[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


def verified(key: AnswerKey, ordered: list, lm_eval_outcomes: pd.DataFrame) -> bool:
    """Whether `key`'s outcomes, computed from the log-likelihoods lm-eval's pass gave its instances (`ordered`, in the
    key's order), equal lm-eval's own outcomes of every item (`zero_shot.item_outcomes` of the task)."""
    scores = [float(instance.resps[0][0]) for instance in ordered]
    theirs = lm_eval_outcomes.sort_values("doc_id", kind="stable").reset_index(drop=True)
    return key.outcomes(key.task, scores).assign(task=theirs["task"]).equals(theirs)


class Keys:
    """A worker's answer keys: read from the request cache's store once, kept in memory (the newest `KEPT`)."""

    def __init__(self):
        self.held: OrderedDict[str, AnswerKey] = OrderedDict()

    def get(self, store, name: str, fields: dict, check) -> AnswerKey | None:
        """The key `name` of `store` (held by its place: another sweep's store is read for itself), taken only once
        `check(key)` has found it to say what its pass's documents and requests say (ValueError otherwise)."""
        place = store.path(name)
        if place in self.held:
            self.held.move_to_end(place)
            return self.held[place]
        data = store.read(name)
        if data is None:
            return None
        try:
            key = AnswerKey.from_bytes(data, fields)
            check(key)
        except Exception as error:  # a damaged entry: lm-eval's pass makes the key again and replaces it
            store.record("damaged", name, error=f"{type(error).__name__}: {str(error)[:200]}")
            return None
        return self.keep(store, name, key)

    def keep(self, store, name: str, key: AnswerKey) -> AnswerKey:
        self.held[store.path(name)] = key
        while len(self.held) > KEPT:
            self.held.popitem(last=False)
        return key


@lru_cache(maxsize=1)
def worker_keys() -> Keys:
    """This process's keys (made on first use: nothing happens at import)."""
    return Keys()
