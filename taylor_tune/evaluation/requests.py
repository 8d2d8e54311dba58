"""A zero-shot pass's requests: built by lm-eval and tokenized once per pass, and with a `RequestCache` once per sweep.

lm-eval builds a task's requests in every pass (`Task.build_all_requests`: its prompt templates rendered for every
document) and HFLM tokenizes every (context, continuation) pair, although in a sweep a model's requests are the same
in every trial. `PassRequests` stands in for that building during one pass: lm-eval builds the requests as always
(or the cache has them), lm-eval's own tokenization of each is computed once and handed to the scorer, and the time
it all takes is counted apart from the scoring. lm-eval still scores the answers (filters, process_results,
aggregation) as always; with a cache, each task's pass also keeps its answer key (`evaluation.answers`), with which a
later pass scores without lm-eval.

A `RequestCache` entry holds one task's requests and their tokens as JSON data, keyed by all they depend on: the
documents lm-eval scores (sha256 of them after its own processing, within the limit), the task's definition (its
templates and functions' source) and lm-eval's version, the tokenizer (sha256 of its serialized state) and HFLM's
tokenization settings, the limit and the scorer. lm-eval's own request cache is not used: it keys by the task's name
only (not its data) and stores pickles, and nothing read from disk here may run code.

Safe when trials ask at once: the first to ask builds under a file lock while the others wait, then read. An entry is
written whole under a temporary name with the sha256 of its rows; before use it is checked (`checked_rows`): the
checksum, every document's requests present and well-formed, and every one tokenized again equal to the stored
tokens. An entry that fails is removed and built again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cached_property, lru_cache
from importlib.metadata import version
from pathlib import Path

from taylor_tune.compat.lm_eval import (
    encode_requests,
    make_instance,
    rendered_once,
    task_definition,
    task_documents,
)
from taylor_tune.evaluation.answers import AnswerKey, verified, worker_keys
from taylor_tune.jsonio import digest, read_entry
from taylor_tune.storage.cache import Store, built_json, json_name

ROW_TYPES = (int, int, str, int, str, str, list, list)


def tokenizer_digest(lm) -> str:
    """What lm-eval's tokenization of a request depends on: the tokenizer's whole serialized state (vocabulary,
    merges, normalizer, pre- and post-processing, special tokens) and HFLM's settings around it."""
    tokenizer = lm.tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return digest([type(tokenizer).__name__, state, str(tokenizer.special_tokens_map), lm.add_bos_token,
                   lm.prefix_token_id, lm.backend])


class RequestCache:
    """Entries of JSON rows in a store (`storage.cache.Store`: the sweep's storage), each built once by all trials."""

    def __init__(self, store: Store | str | Path):
        self.store = store if isinstance(store, Store) else Store(store)

    def get_or_build(self, fields: dict, build: Callable[[], list], read: Callable[[list], object]):
        """(read(rows), built): the rows stored under `fields`; on a miss, or when `read` cannot take the stored rows
        (a damaged entry), `build()`'s rows, stored first (`storage.cache.built_json`)."""
        return built_json(self.store, fields, build, read, part="rows")

    @staticmethod
    def key_name(fields: dict) -> str:
        """The name of the answer key (`evaluation.answers`) of the pass whose request entry has `fields`."""
        return f"{digest(fields)[:24]}.answers"

    def answer_key(self, fields: dict, check: Callable[[AnswerKey], None]) -> AnswerKey | None:
        """The stored answer key of the pass whose request entry has `fields` (this worker's copy once read), taken
        once `check` passes it; a key used is the cache's hit for that task's pass, recorded as a read of its requests
        would be."""
        name = self.key_name(fields)
        key = worker_keys().get(self.store, name, fields, check)
        if key is not None:
            self.store.record("hit", name, via="answer key")
        return key

    def rows(self, fields: dict) -> list | None:
        """The request entry's rows for `fields` as stored (its header and checksum checked), None when it has none;
        ValueError for an entry that is another's or not what its checksum says. Read only: nothing is built."""
        fields = json.loads(json.dumps(fields))  # as the entry's header reads back
        data = self.store.read(json_name(fields))
        return None if data is None else read_entry(data.decode(), fields, "rows")

    def keep_answer_key(self, fields: dict, key: AnswerKey) -> None:
        name = self.key_name(fields)
        self.store.write(name, key.to_bytes(fields))
        worker_keys().keep(self.store, name, key)


class PassRequests:
    """The requests of one zero-shot pass (see the module's docstring): called by `compat.building_requests` for each
    task; `seconds` spent building, reading and tokenizing them, `built`: tasks whose requests lm-eval built."""

    def __init__(self, lm, cache: RequestCache | None = None):
        self.lm, self.cache = lm, cache
        self.seconds, self.built = 0.0, 0
        # (request fields, key, its instances) of each task lm-eval scores in this pass: answer keys to keep
        self.made: dict[str, tuple[dict, AnswerKey, list]] = {}

    @property
    def answering(self) -> bool:
        """Whether this pass's tasks may be answered from keys: with a cache to keep them, for the prefix scorer."""
        return self.cache is not None and getattr(self.lm, "scorer", None) == "prefix"

    def answer_keys(self, tasks: dict[str, object], limit: int | None,
                    samples: dict[str, list[int]] | None) -> dict[str, AnswerKey]:
        """The answer keys kept for these tasks' pass (name -> lm-eval's task object, built once per worker) at
        `limit` (or of the listed `samples`, by task name); a task without one is left out."""
        if not self.answering:
            return {}
        start = time.perf_counter()
        try:
            found = {}
            for name, task in tasks.items():
                listed = None if samples is None else samples[name]
                fields = pass_fields(self, task, limit, listed)
                key = self.cache.answer_key(fields, lambda key, task=task, listed=listed, fields=fields:
                                            self.check_answer_key(task, limit, listed, fields, key))
                if key is not None:
                    found[name] = key
            return found
        finally:
            self.seconds += time.perf_counter() - start

    def check_answer_key(self, task, limit: int | None, samples: list[int] | None, fields: dict,
                         key: AnswerKey) -> None:
        """ValueError unless `key` is the key that the pass's documents and its request entry make (`AnswerKey.of`):
        the entry checked against the documents as a pass reads it (`checked_rows`, its tokens the tokenizer's), each
        item's gold, choices and their lengths from its document. A key's own checksum proves only that it is whole;
        this proves that it says what its items say, before any pass is scored by it (once per worker and key)."""
        rows = self.cache.rows(fields)
        if rows is None:
            raise ValueError("its pass's request entry is gone, so what it says of the items cannot be checked")
        with rendered_once(task):
            instances = self._instances(task, dict(task_documents(task, limit, samples)), rows)
            made = AnswerKey.of(task, instances, [(row[6], row[7]) for row in rows], samples)
        if made is None or not key.same(made[0]):
            raise ValueError("it says other than its items' documents and requests do (a gold, a choice, a token)")

    def keep_answer_keys(self, outcomes: dict[str, object]) -> list[str]:
        """Keep the answer key of each task lm-eval scored in this pass whose outcomes, computed from the key and that
        pass's own log-likelihoods, are lm-eval's (`outcomes`: task's config name -> `item_outcomes` of its items);
        returns the tasks kept."""
        kept = []
        for name, (fields, key, ordered) in self.made.items():
            if name in outcomes and verified(key, ordered, outcomes[name]):
                self.cache.keep_answer_key(fields, key)
                kept.append(name)
        self.made = {}
        return kept

    @cached_property
    def tokenizer(self) -> str:
        """`tokenizer_digest` of the scorer, found once per scorer (its tokenizer's whole state is serialized)."""
        digest_of = getattr(self.lm, "tokenizer_digest", None)
        if digest_of is None:
            digest_of = tokenizer_digest(self.lm)
            try:
                self.lm.tokenizer_digest = digest_of
            except AttributeError:  # a scorer that takes no attributes: found again next pass
                pass
        return digest_of

    @contextmanager
    def scoring(self) -> Iterator[None]:
        """Inside, the scorer takes each request's tokens from this pass (`encoded`) instead of tokenizing it."""
        self.lm.encoded = {}
        try:
            yield
        finally:
            self.lm.encoded = None

    def __call__(self, task, limit: int | None, lm_eval_build: Callable[[], list],
                 samples: list[int] | None = None) -> list:
        start = time.perf_counter()
        try:
            if self.cache is None:
                self.built += 1
                instances = lm_eval_build()
                for (*_, context, continuation, context_ids, continuation_ids) in self._rows(instances):
                    self.lm.encoded[(context, continuation)] = (context_ids, continuation_ids)
                return instances
            docs = dict(task_documents(task, limit, samples))
            fields = self.fields(task, limit, docs, samples)
            instances, built = self.cache.get_or_build(
                fields, lambda: self._rows(lm_eval_build()), lambda rows: self._rows_to_instances(task, docs, rows))
            self.built += built
            if self.answering:
                made = AnswerKey.of(task, instances, [self.lm.encoded[i.arguments] for i in instances], samples)
                if made is not None:
                    self.made[task.config.task] = (fields, *made)
            return instances
        finally:
            self.seconds += time.perf_counter() - start

    def fields(self, task, limit: int | None, docs: dict | None = None, samples: list[int] | None = None) -> dict:
        """The cache key's fields of `task` at `limit` (or of its listed `samples`): the same in every process that
        would build the same requests (a sweep's trials run in several)."""
        return request_fields(task, limit, self.tokenizer, getattr(self.lm, "scorer", None), docs, samples)

    def _rows(self, instances: list) -> list:
        """Each request as a JSON row: doc_id, idx, request type, repeats, context, continuation and lm-eval's tokens
        of the two."""
        tokens = encode_requests(self.lm, instances)
        return [[i.doc_id, i.idx, i.request_type, i.repeats, *i.arguments, *encoded]
                for i, encoded in zip(instances, tokens, strict=True)]

    def _instances(self, task, docs: dict, rows: list) -> list:
        """lm-eval's instances of a stored entry's rows, once the rows are found to be the pass's requests
        (`checked_rows`) and their tokens the tokenizer's (every request tokenized again: a sample would let an
        edited token outside it through, and with it a key made from that token)."""
        name = task.config.task
        instances = [make_instance(request_type, docs[doc_id], (context, continuation), idx, name, doc_id, repeats)
                     for doc_id, idx, request_type, repeats, context, continuation, *_
                     in checked_rows(task, docs, rows)]
        for i, tokens in enumerate(encode_requests(self.lm, instances)):
            if [list(t) for t in tokens] != [list(t) for t in rows[i][6:]]:
                raise ValueError(f"{task.config.task}: document {rows[i][0]}'s request {rows[i][1]} holds other "
                                 "tokens than the tokenizer gives")
        return instances

    def _rows_to_instances(self, task, docs: dict, rows: list) -> list:
        instances = self._instances(task, docs, rows)
        for *_, context, continuation, context_ids, continuation_ids in rows:
            self.lm.encoded[(context, continuation)] = (context_ids, continuation_ids)
        return instances


def request_fields(task, limit: int | None, tokenizer: str, scorer: str | None, docs: dict | None = None,
                   samples: list[int] | None = None) -> dict:
    """The fields of a request entry (see `PassRequests.fields`); `docs`: the pass's documents, if at hand."""
    docs = dict(task_documents(task, limit, samples)) if docs is None else docs
    return {"task": task.config.task, "docs": digest(list(docs.items())), "definition": digest(task_definition(task)),
            "lm_eval": version("lm_eval"), "tokenizer": tokenizer, "limit": limit,
            "scorer": scorer} | ({"samples": digest(samples)} if samples else {})


def pass_fields(requests: PassRequests, task, limit: int | None, samples: list[int] | None) -> dict:
    """`requests.fields` of `task`'s pass, found once per worker (the documents' digest reads every document)."""
    return dict(_pass_fields(task, limit, requests.tokenizer, getattr(requests.lm, "scorer", None),
                             None if samples is None else tuple(samples)))


@lru_cache(maxsize=256)
def _pass_fields(task, limit: int | None, tokenizer: str, scorer: str | None, samples: tuple | None) -> tuple:
    return tuple(request_fields(task, limit, tokenizer, scorer, None, None if samples is None else list(samples))
                 .items())


def checked_rows(task, docs: dict, rows: object) -> list:
    """A stored entry's rows, checked to be every request of the pass: each row of the stored shape and types, every
    document's requests numbered 0..k-1, no document missing or foreign, and for a multiple-choice task as many as
    its choices, each its own choice and its own document's text (ValueError naming the task and document)."""
    name = task.config.task
    if not isinstance(rows, list):
        raise ValueError(f"{name}: the entry holds no list of requests")
    per_doc: dict[int, list[int]] = {}
    for row in rows:
        if not (isinstance(row, list) and len(row) == len(ROW_TYPES)
                and all(isinstance(v, t) and not isinstance(v, bool) for v, t in zip(row, ROW_TYPES))
                and set(map(type, row[6])) | set(map(type, row[7])) <= {int}):  # bools are not token ids
            raise ValueError(f"{name}: a request row is not (doc_id, idx, type, repeats, context, continuation, "
                             "tokens, tokens)")
        per_doc.setdefault(row[0], []).append(row[1])
    if set(per_doc) != set(docs):
        missing, foreign = sorted(set(docs) - set(per_doc)), sorted(set(per_doc) - set(docs))
        raise ValueError(f"{name}: the entry's requests miss documents {missing[:5]} / name unknown ones "
                         f"{foreign[:5]}")
    multiple_choice = getattr(task, "OUTPUT_TYPE", None) == "multiple_choice"
    choices = {doc_id: task.doc_to_choice(docs[doc_id]) for doc_id in per_doc} if multiple_choice else {}
    if multiple_choice:  # lm-eval's construct_requests: a log-likelihood request per choice, the task's repeats
        wrong = next((row for row in rows if (row[2], row[3]) != ("loglikelihood", task.config.repeats)), None)
        if wrong is not None:
            raise ValueError(f"{name}: document {wrong[0]}'s request {wrong[1]} is a {wrong[2]!r} request repeated "
                             f"{wrong[3]} times, not a log-likelihood repeated {task.config.repeats}")
    for doc_id, idxs in per_doc.items():
        expected = len(choices[doc_id]) if multiple_choice else len(idxs)
        if sorted(idxs) != list(range(expected)):
            raise ValueError(f"{name}: document {doc_id} has requests {sorted(idxs)[:8]}, expected 0..{expected - 1}")
    if multiple_choice:  # each request names its own choice (lm-eval's construct_requests), not another's
        delimiter, in_context = task.config.target_delimiter, bool(getattr(task, "multiple_input", False))
        # and holds its own document's text: the context ends with the rendered question, or (the choices in the
        # context, as Winogrande) the continuation is the rendered target
        shared = {doc_id: task.doc_to_target(docs[doc_id]) if in_context else task.doc_to_text(docs[doc_id])
                  for doc_id in per_doc}
        for doc_id, idx, _, _, context, continuation, *_ in rows:
            choice = choices[doc_id][idx]
            if not (context.endswith(choice) if in_context else continuation == f"{delimiter}{choice}"):
                raise ValueError(f"{name}: document {doc_id}'s request {idx} holds other text than its choice "
                                 f"{choice[:40]!r} (lm-eval's own request for it)")
            own = shared[doc_id]
            if isinstance(own, str) and not (continuation == f"{delimiter}{own}" if in_context
                                             else context.endswith(own)):
                raise ValueError(f"{name}: document {doc_id}'s request {idx} holds another text than its document's "
                                 f"{own[-40:]!r} (lm-eval's own request for it)")
    return rows
