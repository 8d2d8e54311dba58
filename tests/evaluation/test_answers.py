"""Issue 84: a later pass answers from the answer keys an earlier pass kept, without lm-eval, and reports exactly what
lm-eval reports: every task's entry and every item's outcome, against lm-eval's own pass over another model; each
item's acc and acc_norm against lm-eval's rule written out item by item; a key that lm-eval's answers do not confirm
is never kept; a damaged one is refused and made again."""

import numpy as np
import pandas as pd
import pytest
import torch

import taylor_tune.evaluation.zero_shot as zs
from taylor_tune.config import build_eval_spec
from taylor_tune.evaluation.answers import AnswerKey, worker_keys
from taylor_tune.evaluation.evaluate import Evaluator
from taylor_tune.evaluation.requests import RequestCache
from taylor_tune.evaluation.scorer import PrefixLM
from taylor_tune.sources.models import load_model, load_tokenizer

TASKS = ("boolq", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")


@pytest.fixture
def lm_eval_calls(monkeypatch):
    """The tasks of every call a pass makes to lm-eval's simple_evaluate."""
    real, calls = zs.simple_evaluate, []

    def recorded(**kwargs):
        calls.append(sorted(t if isinstance(t, str) else t["task"] for t in kwargs["tasks"]))
        return real(**kwargs)

    monkeypatch.setattr(zs, "simple_evaluate", recorded)
    return calls


@pytest.fixture(scope="module")
def models():
    """The trained tiny model, and a copy with its weights moved: other answers to the same requests."""
    tokenizer = load_tokenizer("tiny-llama")
    moved = load_model("tiny-llama")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in moved.parameters():
            weight.add_(0.3 * weight.std() * torch.randn(weight.shape, generator=generator))
    return load_model("tiny-llama"), moved, tokenizer


def a_new_worker() -> None:
    """Forget the keys this process read or made: the next pass reads them from the cache as a new worker does."""
    worker_keys().held.clear()


def spec(**kw):
    return build_eval_spec({"task_data": "world", "ppl": None, "limit": 40, **kw})


def same_outcomes(a: pd.DataFrame, b: pd.DataFrame) -> None:
    key = ["task", "doc_id"]
    pd.testing.assert_frame_equal(a.sort_values(key).reset_index(drop=True), b.sort_values(key).reset_index(drop=True))


@pytest.mark.parametrize("listed", [False, True], ids=["limit", "listed items"])
def test_a_later_pass_answers_from_kept_keys_what_lm_eval_answers(models, lm_eval_calls, tmp_path, listed):
    """One model's pass through lm-eval keeps a key per task; another model's pass in a new worker scores all seven
    tasks from the keys (lm-eval not called, no request built) and reports exactly what lm-eval's own pass over that
    model reports: each task's entry (scores, stderrs, n, halves) and each item's acc and acc_norm. At a limit and
    on listed items (a race's blocks, reported by their index in the task)."""
    first, moved, tokenizer = models
    samples = {t: [37, 2, 11, 30, 5, 22, 19, 8][: 5 + i % 3] for i, t in enumerate(TASKS)} if listed else None
    cache = RequestCache(tmp_path / "requests")
    Evaluator(first, tokenizer, spec(), request_cache=cache).zero_shot(40, samples)
    assert len(lm_eval_calls) == 1 and len(list((tmp_path / "requests").glob("*.answers"))) == len(TASKS)
    a_new_worker()
    answered = Evaluator(moved, tokenizer, spec(), request_cache=cache).zero_shot(40, samples)
    assert len(lm_eval_calls) == 1, "the later pass went through lm-eval"
    assert answered.requests_built == 0 and answered.tokens > 0
    reference = Evaluator(moved, tokenizer, spec()).zero_shot(40, samples)  # no cache: lm-eval's own pass
    assert len(lm_eval_calls) == 2
    assert answered.tasks == reference.tasks
    same_outcomes(answered.outcomes, reference.outcomes)
    normed = reference.outcomes.dropna(subset=["acc_norm"])  # outcomes that vary; a length normalisation that matters
    assert answered.outcomes["acc"].std() > 0 and (listed or (normed["acc"] != normed["acc_norm"]).any())


def lm_eval_rule(lls: list[float], lengths: list[float], gold: int) -> tuple[float, float]:
    """lm-eval 0.4.13's ConfigurableTask.process_results for one multiple-choice item, written out."""
    pred, pred_norm = np.argmax(lls), np.argmax(np.array(lls) / np.array(lengths))
    return (1.0 if pred == gold else 0.0), (1.0 if pred_norm == gold else 0.0)


def test_each_items_outcome_is_lm_evals_rule_item_by_item():
    """Random items of 2 to 5 choices, log-likelihoods with ties (the first maximum wins, as np.argmax), gold
    indices (one item with none lm-eval can find) and lengths in characters: `AnswerKey.outcomes` equals the rule
    written out per item, and the key reports acc_norm only for a task that has it."""
    rng = np.random.default_rng(0)
    rows, expected = [], []
    for doc in range(300):
        k = int(rng.integers(2, 6))
        lls = list(rng.integers(-6, 0, size=k).astype(float))  # few values: many ties
        lengths = list(rng.integers(1, 9, size=k).astype(float))
        gold = -1 if doc == 7 else int(rng.integers(0, k))
        rows += [(doc * 3, i, i == gold, lengths[i], lls[i]) for i in range(k)]
        expected.append((doc * 3, *lm_eval_rule(lls, lengths, gold)))
    doc_id, idx, gold, chars, lls = map(np.array, zip(*rows))
    tokens = [[1] * int(c) for c in chars]  # as many tokens as characters would hide a normalisation by tokens
    tokens = [t[: 1 + i % 3] for i, t in enumerate(tokens)]
    key = AnswerKey("t", ("acc", "acc_norm"), doc_id.astype(np.int64), idx.astype(np.int32), gold, chars,
                    [[5]] * len(rows), tokens)
    key.check()
    got = key.outcomes("t", lls)
    want = pd.DataFrame(expected, columns=["doc_id", "acc", "acc_norm"])
    pd.testing.assert_frame_equal(got[["doc_id", "acc", "acc_norm"]], want)
    assert 0 < got["acc"].mean() < 1 and (got["acc"] != got["acc_norm"]).any()
    only_acc = AnswerKey("t", ("acc",), *(getattr(key, f) for f in ("doc_id", "idx", "gold", "chars", "contexts",
                                                                      "continuations")))
    assert only_acc.outcomes("t", lls)["acc_norm"].isna().all()


def test_a_key_lm_evals_answers_do_not_confirm_is_not_kept(models, lm_eval_calls, tmp_path, monkeypatch):
    """A key whose outcomes, from the pass's own log-likelihoods, differ from lm-eval's on one item is not kept:
    the next pass goes through lm-eval again."""
    first, _, tokenizer = models
    real = AnswerKey.outcomes

    def one_wrong(self, task, loglikelihoods):
        frame = real(self, task, loglikelihoods)
        return frame.assign(acc=frame["acc"].where(frame.index != 3, 1.0 - frame["acc"]))

    monkeypatch.setattr(AnswerKey, "outcomes", one_wrong)
    cache = RequestCache(tmp_path / "requests")
    Evaluator(first, tokenizer, spec(tasks="piqa,arc_easy"), request_cache=cache).zero_shot(40)
    assert not list((tmp_path / "requests").glob("*.answers"))
    a_new_worker()
    Evaluator(first, tokenizer, spec(tasks="piqa,arc_easy"), request_cache=cache).zero_shot(40)
    assert len(lm_eval_calls) == 2


def test_a_damaged_key_is_refused_the_pass_mixes_and_the_key_is_made_again(models, lm_eval_calls, tmp_path):
    """A key changed on disk is refused by its checksum: that task alone goes through lm-eval (the others from their
    keys), the pass still reports what lm-eval's own pass reports, and the key is made again."""
    first, moved, tokenizer = models
    cache = RequestCache(tmp_path / "requests")
    tasks = "piqa,hellaswag,arc_easy"
    Evaluator(first, tokenizer, spec(tasks=tasks), request_cache=cache).zero_shot(40)
    keys = {key_task(path): path for path in (tmp_path / "requests").glob("*.answers")}
    damaged = keys["hellaswag_offline"]
    data = bytearray(damaged.read_bytes())
    data[-40] ^= 0xFF
    damaged.write_bytes(bytes(data))
    a_new_worker()
    mixed = Evaluator(moved, tokenizer, spec(tasks=tasks), request_cache=cache).zero_shot(40)
    assert lm_eval_calls[1:] == [["hellaswag_offline"]]
    reference = Evaluator(moved, tokenizer, spec(tasks=tasks)).zero_shot(40)
    assert mixed.tasks == reference.tasks
    same_outcomes(mixed.outcomes, reference.outcomes)
    a_new_worker()
    Evaluator(moved, tokenizer, spec(tasks=tasks), request_cache=cache).zero_shot(40)
    assert len(lm_eval_calls) == 3  # the reference's; the key was made again


def key_task(path) -> str:  # noqa: N802
    import json

    return json.loads(path.read_bytes().partition(b"\n")[0])["task"]


def test_a_key_reads_back_equal_and_refuses_another_ones_or_a_broken_one():
    """to_bytes / from_bytes: the same key back; another pass's fields, a changed payload, a gap in an item's
    choices, two golds: ValueError naming what is wrong."""
    key = AnswerKey("t", ("acc", "acc_norm"), np.array([0, 0, 4, 4, 4]), np.array([0, 1, 0, 1, 2], dtype=np.int32),
                    np.array([False, True, True, False, False]), np.array([3.0, 5.0, 1.0, 2.0, 7.0]),
                    [[1, 2], [1, 2], [9], [9], [9]], [[3], [4, 5], [6], [7], [8, 8]])
    back = AnswerKey.from_bytes(key.to_bytes({"f": 1}), {"f": 1})
    for field in ("doc_id", "idx", "gold", "chars"):
        assert np.array_equal(getattr(back, field), getattr(key, field)) and \
            getattr(back, field).dtype == getattr(key, field).dtype
    assert (back.contexts, back.continuations, back.metrics, back.task) == \
        (key.contexts, key.continuations, key.metrics, key.task)
    with pytest.raises(ValueError, match="another one's"):
        AnswerKey.from_bytes(key.to_bytes({"f": 1}), {"f": 2})
    data = bytearray(key.to_bytes({"f": 1}))
    data[-10] ^= 1
    with pytest.raises(ValueError, match="checksum"):
        AnswerKey.from_bytes(bytes(data), {"f": 1})
    gap = AnswerKey(key.task, key.metrics, key.doc_id, np.array([0, 1, 0, 2, 3], dtype=np.int32), key.gold,
                    key.chars, key.contexts, key.continuations)
    with pytest.raises(ValueError, match="choices 0..k-1"):
        AnswerKey.from_bytes(gap.to_bytes({"f": 1}), {"f": 1})
    two = AnswerKey(key.task, key.metrics, key.doc_id, key.idx, np.array([True, True, False, False, True]),
                    key.chars, key.contexts, key.continuations)
    with pytest.raises(ValueError, match="more than one gold"):
        AnswerKey.from_bytes(two.to_bytes({"f": 1}), {"f": 1})


class Answering(PrefixLM):
    """Answers from the tokens alone (no model), by a rule that `salt` changes: other answers to the same requests."""

    salt = 0

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, override_bs=None):
        return [(-len(context) - ((sum(continuation) * (self.salt + 7)) % 101) / 10 - len(continuation) / 3,
                 len(continuation) % 2 == 0) for _, context, continuation in requests]


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m", "qwen2.5-0.5b"])
def test_on_the_real_tasks_a_later_pass_answers_what_lm_eval_answers(assets, model, tmp_path, lm_eval_calls):
    """The seven real tasks at 150 items with each real model's tokenizer: a pass through lm-eval keeps the keys; a
    new worker's pass with other answers scores every task from them and reports exactly what lm-eval's stock
    `simple_evaluate` reports for those answers: each task's acc and acc_norm with their stderrs, and each item's."""
    from lm_eval import simple_evaluate

    from taylor_tune.compat.lm_eval import without_environment_record
    from taylor_tune.evaluation.requests import PassRequests

    spec = build_eval_spec({"task_data": "real", "ppl": None, "limit": 150})
    tokenizer = load_tokenizer(model)

    def answering(salt):
        lm = Answering(pretrained=load_model("tiny-llama-random"), tokenizer=tokenizer, device="cpu", batch_size=16)
        lm.scorer, lm.salt = "prefix", salt
        return lm

    cache = RequestCache(tmp_path / "requests")
    zs.zero_shot(answering(0), spec, "real", PassRequests(answering(0), cache))
    a_new_worker()
    lm = answering(1)
    tasks, _, outcomes = zs.zero_shot(lm, spec, "real", PassRequests(lm, cache))
    assert len(lm_eval_calls) == 1, "the later pass went through lm-eval"
    sources = [zs.task_source(task, "real") for task in spec.tasks]
    with without_environment_record():
        stock = simple_evaluate(model=answering(1), tasks=[s for s, _ in sources], task_manager=sources[0][1],
                                limit=150, bootstrap_iters=1000, log_samples=True, verbosity="ERROR")
    for task, (source, _) in zip(spec.tasks, sources):
        name = zs.result_name(source)
        raw = stock["results"][name]
        for metric in ("acc", "acc_norm"):
            assert tasks[task][metric] == raw.get(f"{metric},none"), (task, metric)
            assert tasks[task][f"{metric}_stderr"] == raw.get(f"{metric}_stderr,none"), (task, metric)
        same_outcomes(outcomes[outcomes["task"] == task], zs.item_outcomes({task: stock["samples"][name]}))
    assert outcomes["acc"].std() > 0
