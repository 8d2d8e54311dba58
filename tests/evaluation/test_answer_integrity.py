"""Issue 91, case 2 and must-show 2: a stored answer key or request entry is trusted only for what it says of its
documents. Any single edit of one entry that changes what it says (a gold flag, a choice's length, an item's or a
choice's number, one token, another item's tokens, the request's text or type), with its checksum recomputed, is
found before a pass is scored by it: the pass's accuracies are a clean pass's, and the entry is made again as it was.
Before, a key was taken on its checksum alone: piqa's gold moved to the next choice gave acc 0.0 where it is 1.0."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import taylor_tune.evaluation.zero_shot as zs
from taylor_tune.config import build_eval_spec
from taylor_tune.evaluation.answers import AnswerKey, worker_keys
from taylor_tune.evaluation.requests import PassRequests, RequestCache, pass_fields
from taylor_tune.jsonio import entry_text, read_entry
from taylor_tune.sources.models import load_model, load_tokenizer
from taylor_tune.storage.cache import json_name
from tests.evaluation.test_answers import Answering, same_outcomes

pytestmark = pytest.mark.slow  # an lm-eval pass per example

TASKS = ("piqa", "boolq", "winogrande")
SPEC = build_eval_spec({"task_data": "world", "ppl": None, "limit": 8, "tasks": ",".join(TASKS)})


def answering(salt: int) -> Answering:
    lm = Answering(pretrained=load_model("tiny-llama-random"), tokenizer=load_tokenizer("tiny-llama"), device="cpu",
                   batch_size=16)
    lm.scorer, lm.salt = "prefix", salt
    return lm


def a_pass(lm, folder=None):
    worker_keys().held.clear()  # a new worker: the keys are read from the store
    requests = PassRequests(lm, None if folder is None else RequestCache(folder))
    return zs.zero_shot(lm, SPEC, "world", requests)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A cache made by a clean pass (a key and a request entry per task), what is stored under each task's name, and
    the reference: lm-eval's own pass (no cache) with other answers."""
    folder = tmp_path_factory.mktemp("clean") / "requests"
    a_pass(answering(0), folder)
    lm = answering(1)
    stored = {}
    for task in TASKS:
        fields = json.loads(json.dumps(pass_fields(PassRequests(lm), zs.built_task(task, "world"), SPEC.limit, None)))
        stored[task] = {"fields": fields, "key": RequestCache.key_name(fields), "rows": json_name(fields)}
        assert (folder / stored[task]["key"]).is_file() and (folder / stored[task]["rows"]).is_file()
    tasks, _, outcomes = a_pass(answering(1))
    assert outcomes["acc"].std() > 0
    return folder, stored, tasks, outcomes


KEY_EDITS = ("gold", "chars", "doc_id", "idx", "context token", "continuation token", "next item's context",
             "metrics")
ROW_EDITS = ("doc_id", "idx", "type", "repeats", "context text", "continuation text", "context token",
             "continuation token", "next item's context")


def edit_key(key: AnswerKey, edit: str, row: int, delta: int) -> AnswerKey:
    row %= len(key.idx)
    change = {}
    if edit in ("gold", "chars", "doc_id", "idx"):
        values = getattr(key, edit).copy()
        values[row] = (not values[row]) if edit == "gold" else values[row] + delta
        change[edit] = values
    elif edit in ("context token", "continuation token"):
        field = "contexts" if edit.startswith("context") else "continuations"
        lists = [list(t) for t in getattr(key, field)]
        lists[row][delta % len(lists[row])] += delta
        change[field] = lists
    elif edit == "next item's context":  # each request given the next item's context tokens
        later = np.flatnonzero(key.doc_id != key.doc_id[row])
        contexts = list(key.contexts)
        contexts[row] = list(key.contexts[later[0]] if len(later) else key.contexts[row][:-1])
        change["contexts"] = contexts
    else:
        change["metrics"] = ("acc",) if "acc_norm" in key.metrics else ("acc", "acc_norm")
    return dataclasses.replace(key, **change)


def edit_rows(rows: list, edit: str, row: int, delta: int) -> list:
    rows = json.loads(json.dumps(rows))
    row %= len(rows)
    target = rows[row]
    if edit in ("doc_id", "idx", "repeats"):
        target[{"doc_id": 0, "idx": 1, "repeats": 3}[edit]] += delta
    elif edit == "type":
        target[2] = "loglikelihood_rolling"
    elif edit == "context text":
        target[4] = target[4] + " x" * delta
    elif edit == "continuation text":
        target[5] = target[5][:-1] if delta % 2 else target[5] + "s"
    elif edit in ("context token", "continuation token"):
        tokens = target[6 if edit.startswith("context") else 7]
        tokens[delta % len(tokens)] += delta
    else:
        other = next((r for r in rows if r[0] != target[0]), None)
        assume(other is not None and other[6] != target[6])
        target[6] = list(other[6])
    return rows


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(task=st.sampled_from(TASKS), entry=st.sampled_from(["key", "rows"]), edit=st.integers(0, 100),
       row=st.integers(0, 10_000), delta=st.integers(1, 40))
@example(task="piqa", entry="key", edit=KEY_EDITS.index("gold"), row=0, delta=1)
@example(task="boolq", entry="key", edit=KEY_EDITS.index("next item's context"), row=0, delta=1)
@example(task="piqa", entry="rows", edit=ROW_EDITS.index("context token"), row=5, delta=3)
def test_any_single_edit_of_a_stored_entry_is_found_and_the_pass_is_a_clean_ones(clean, tmp_path_factory, task,
                                                                                  entry, edit, row, delta):
    folder, stored, tasks, reference = clean
    here = tmp_path_factory.mktemp("edited") / "requests"
    shutil.copytree(folder, here)
    fields, name = stored[task]["fields"], stored[task][entry]
    original = (here / name).read_bytes()
    if entry == "key":
        kind = KEY_EDITS[edit % len(KEY_EDITS)]
        key = AnswerKey.from_bytes(original, fields)
        edited = edit_key(key, kind, row, delta).to_bytes(fields)  # its checksum recomputed
        assume(edited != original)
        (here / name).write_bytes(edited)
    else:
        kind = ROW_EDITS[edit % len(ROW_EDITS)]
        rows = read_entry(original.decode(), fields, "rows")
        edited = edit_rows(rows, kind, row, delta)
        assume(edited != rows)
        (here / name).write_text(entry_text(fields, "rows", edited))  # its checksum recomputed
    got, _, outcomes = a_pass(answering(1), here)
    assert got == tasks, (task, entry, kind)
    same_outcomes(outcomes, reference)
    assert (here / name).read_bytes() == original, (task, entry, kind)  # made again, as it was
    for other in TASKS:  # and nothing else was changed
        for part in ("key", "rows"):
            assert (here / stored[other][part]).read_bytes() == (folder / stored[other][part]).read_bytes()
