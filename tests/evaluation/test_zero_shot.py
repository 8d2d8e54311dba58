"""zero_shot's accounting against a recomputation from lm-eval's own per-item records, and its failures named by
where they came from. Real lm-eval on the offline world with a tiny model (about a second a call)."""

import logging
import math
import time

import pandas as pd
import pytest
import torch

import taylor_tune.evaluation.zero_shot as zs
from taylor_tune.config import ZERO_SHOT_TASKS, build_eval_spec
from taylor_tune.errors import EvaluationError
from taylor_tune.evaluation.requests import PassRequests
from taylor_tune.evaluation.scorer import make_lm
from taylor_tune.sources.models import load_model, load_tokenizer


@pytest.fixture(scope="module")
def lm():
    return make_lm(load_model("tiny-llama"), load_tokenizer("tiny-llama"), 16)


@pytest.fixture
def lm_eval_calls(monkeypatch):
    """Every call zero_shot makes to lm-eval's real simple_evaluate, with what it returned."""
    real, calls = zs.simple_evaluate, []

    def recorded(**kwargs):
        calls.append({"tasks": kwargs["tasks"]})
        calls[-1]["result"] = real(**kwargs)
        return calls[-1]["result"]

    monkeypatch.setattr(zs, "simple_evaluate", recorded)
    return calls


def spec(**kw):
    return build_eval_spec({"task_data": "world", "ppl": None, "limit": 16, **kw})


def test_each_tasks_numbers_equal_a_recomputation_from_the_items(lm, lm_eval_calls, caplog):
    """Per task: the metric's mean and standard error over the items lm-eval scored, both metrics, the item count,
    and the two halves by document parity, all recomputed with pandas from lm-eval's per-item samples; the metric as
    the spec names it (two tasks overridden)."""
    requests, started = PassRequests(lm), time.perf_counter()
    with caplog.at_level(logging.INFO, logger="taylor_tune.evaluation.zero_shot"):
        out, seconds, _ = zs.zero_shot(lm, spec(metrics={"arc_challenge": "acc", "piqa": "acc_norm"}), "world",
                                       requests)
    (call,) = lm_eval_calls  # one lm-eval call for all seven tasks
    assert len(call["tasks"]) == len(ZERO_SHOT_TASKS) and 0 < seconds <= time.perf_counter() - started
    assert requests.built == len(ZERO_SHOT_TASKS)  # the pass's requests came from the object given
    lines = [r.getMessage() for r in caplog.records if r.name == "taylor_tune.evaluation.zero_shot"]
    assert lines == [f"{t}: {e['metric']} {e['score']:.4f} (n={e['n']})" for t, e in out.items()] + [
        f"zero-shot: 7 tasks, {7 * 16} items in {seconds:.1f}s"]
    samples = call["result"]["samples"]
    assert set(out) == set(ZERO_SHOT_TASKS)
    halves_differ = metrics_differ = False
    for task, entry in out.items():
        items = pd.DataFrame(samples[f"{task}_offline"])
        # LLM-Pruner's metrics (acc for BoolQ, PIQA, WinoGrande, ARC-e), but the two overridden above
        metric = {"boolq": "acc", "winogrande": "acc", "arc_easy": "acc", "arc_challenge": "acc"}.get(task, "acc_norm")
        assert entry["metric"] == metric and entry["n"] == len(items) == 16
        for name in ("acc", "acc_norm"):
            if name in items:
                assert entry[name] == pytest.approx(items[name].mean(), abs=1e-12)
                sem = items[name].std(ddof=1) / math.sqrt(len(items))
                assert entry[f"{name}_stderr"] == pytest.approx(sem, abs=1e-12)
            else:
                assert entry[name] is None and entry[f"{name}_stderr"] is None
        assert (entry["score"], entry["score_stderr"]) == (entry[metric], entry[f"{metric}_stderr"])
        even = items["doc_id"] % 2 == 0
        assert entry["score_sel"] == pytest.approx(items.loc[even, metric].mean(), abs=1e-12)
        assert entry["score_heldout"] == pytest.approx(items.loc[~even, metric].mean(), abs=1e-12)
        assert (entry["n_sel"], entry["n_heldout"]) == (even.sum(), (~even).sum())
        halves_differ |= entry["score_sel"] != entry["score_heldout"]
        metrics_differ |= "acc_norm" in items and entry["acc"] != entry["acc_norm"]
    assert halves_differ and metrics_differ  # the world at this limit tells each swap apart


def test_results_are_read_under_the_name_lm_eval_gives_each_task():
    """A hub task by its registered name, an offline one by its config's (what lm-eval keys `results` by)."""
    assert zs.result_name("piqa") == "piqa"
    assert zs.result_name(zs.task_source("piqa", "world")[0]) == "piqa_offline"


def test_one_item_has_no_standard_error(lm):
    """lm-eval reports a standard error over one item as "N/A": no number, not a failure."""
    out, _, _ = zs.zero_shot(lm, spec(limit=1, tasks="boolq,arc_easy"), "world")
    assert out["boolq"]["n"] == out["arc_easy"]["n"] == 1
    assert out["boolq"]["acc_stderr"] is None and out["arc_easy"]["acc_norm_stderr"] is None
    assert out["arc_easy"]["score"] in (0.0, 1.0) and out["arc_easy"]["score_stderr"] is None


def test_split_scores_of_no_items_in_a_half_is_none_not_a_division_by_zero():
    assert zs.split_scores([{"doc_id": 4, "acc": 1.0}, {"doc_id": 0, "acc": 0.0}], "acc") == {
        "score_sel": 0.5, "n_sel": 2, "score_heldout": None, "n_heldout": 0}
    assert zs.split_scores([], "acc_norm") == {"score_sel": None, "n_sel": 0, "score_heldout": None, "n_heldout": 0}


def test_out_of_memory_is_the_models_failure_and_is_not_run_again_task_by_task(lm_eval_calls):
    """A forward that fails as a GPU out of memory does (the error type exists without one): reported for the pass,
    not blamed on a task, and not repeated task by task."""
    model = load_model("tiny-llama")

    def out_of_memory(module, args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

    model.register_forward_pre_hook(out_of_memory)
    with pytest.raises(EvaluationError, match=r"^zero-shot: OutOfMemoryError: CUDA out of memory\. Tried to allocate "
                                              r"2\.00 GiB$"):
        zs.zero_shot(make_lm(model, load_tokenizer("tiny-llama"), 16), spec(tasks="boolq,piqa"), "world")
    assert len(lm_eval_calls) == 1


@pytest.mark.parametrize("message, piqa_fails, expected", [
    ("pooled batch broke\nsecond line not shown", False, "zero-shot: RuntimeError: pooled batch broke"),
    ("", False, "zero-shot: RuntimeError: "),  # an error without a message
    ("pooled batch broke", True, "task piqa: ValueError: piqa row 3 broke"),
])
def test_a_failure_is_named_by_the_task_that_repeats_it_alone_or_else_the_pass(lm, monkeypatch, message, piqa_fails,
                                                                                expected):
    """The pooled call fails; then each task runs alone: the first that fails names the error (its type and first
    line), and if none does, the error is the pass's."""
    real, calls = zs.simple_evaluate, []

    def failing(**kwargs):
        names = [t["task"] for t in kwargs["tasks"]]
        calls.append(names)
        if len(calls) == 1:
            raise RuntimeError(message)
        if piqa_fails and names == ["piqa_offline"]:
            raise ValueError("piqa row 3 broke\ntraceback follows")
        return real(**kwargs)

    monkeypatch.setattr(zs, "simple_evaluate", failing)
    with pytest.raises(EvaluationError) as caught:
        zs.zero_shot(lm, spec(tasks="boolq,piqa,arc_easy"), "world")
    assert str(caught.value) == expected
    alone = [["boolq_offline"], ["piqa_offline"]] if piqa_fails else [[f"{t}_offline"] for t in ("boolq", "piqa",
                                                                                                   "arc_easy")]
    assert calls == [["boolq_offline", "piqa_offline", "arc_easy_offline"], *alone]  # the pass, then each alone


@pytest.mark.parametrize("scorer, cached", [("prefix", False), ("prefix", True), ("hflm", False)])
def test_listed_items_score_as_in_the_full_pass_and_keep_their_indices(tmp_path, scorer, cached):
    """`samples` (a race's blocks): each listed item's outcome (acc and acc_norm) equals its outcome in a pass over
    every item, under its own index in the task (lm-eval numbers listed items 0..k-1; zero_shot gives the index
    back), and the task's score is the mean over exactly those items. Through the request cache too: a listed pass
    is keyed apart from the full one."""
    from taylor_tune.evaluation.requests import RequestCache

    lm = make_lm(load_model("tiny-llama"), load_tokenizer("tiny-llama"), 16, scorer=scorer)
    cache = RequestCache(tmp_path / "requests") if cached else None
    tasks = "boolq,piqa,hellaswag"
    full = zs.zero_shot(lm, spec(tasks=tasks, limit=None), "world", PassRequests(lm, cache))[2]
    full = full.set_index(["task", "doc_id"])
    listed = {"boolq": [150, 3, 77, 12, 199], "piqa": [0, 198, 64], "hellaswag": [5, 4, 120, 33]}
    out, _, items = zs.zero_shot(lm, spec(tasks=tasks, limit=None), "world", PassRequests(lm, cache), samples=listed)
    items = items.set_index(["task", "doc_id"])
    expected = [(task, i) for task in sorted(listed) for i in sorted(listed[task])]
    assert sorted(items.index) == expected
    pd.testing.assert_frame_equal(items.loc[expected], full.loc[expected])
    for task, ids in listed.items():
        assert out[task]["n"] == len(ids)
        assert out[task]["acc"] == pytest.approx(full.loc[[(task, i) for i in ids], "acc"].mean(), abs=1e-12)


def test_passes_that_add_items_report_what_one_pass_over_all_of_them_reports():
    """Issue 66: on seeded blocks a pass scores only the items the pass before lacked and reports every item from
    the outcomes (`Evaluator.zero_shot_adding`); that equals one lm-eval pass over the same items (the scores, n and
    halves exactly, lm-eval's stderr to rounding), for a block of a few items and for the rest of every task, and a
    task whose items ran out adds nothing."""
    from taylor_tune.evaluation.evaluate import Evaluator
    from taylor_tune.sweep.racing import Blocks

    # the random-weight tiny model: near chance, so each task's outcomes vary (the trained one is right on all)
    evaluator = Evaluator(load_model("tiny-llama-random"), load_tokenizer("tiny-llama-random"),
                          spec(tasks="piqa,hellaswag,arc_easy", ppl=None, batch_size=16))
    sizes = zs.task_sizes(("piqa", "hellaswag", "arc_easy"), "world")
    blocks = Blocks.plan(sizes, (5, 13, 14), seed=3)
    first = evaluator.zero_shot(5, blocks.items(0))
    second = evaluator.zero_shot_adding(first, 13, blocks.new_items(1))
    last = evaluator.zero_shot_adding(second, None, blocks.new_items(2))
    for added, alone in ((second, evaluator.zero_shot(13, blocks.items(1))), (last, evaluator.zero_shot(None))):
        assert added.tasks.keys() == alone.tasks.keys()
        for task, entry in alone.tasks.items():
            mine = added.tasks[task]
            assert {k: mine[k] for k in entry if not k.endswith("stderr")} == \
                   {k: v for k, v in entry.items() if not k.endswith("stderr")}, task
            assert all(mine[k] == pytest.approx(v, rel=1e-12) for k, v in entry.items() if k.endswith("stderr"))
        key = ["task", "doc_id"]
        pd.testing.assert_frame_equal(added.outcomes.sort_values(key).reset_index(drop=True),
                                      alone.outcomes.sort_values(key).reset_index(drop=True))
    assert last.tasks["piqa"]["n"] == sizes["piqa"] and 0 < second.tokens < last.tokens
    assert all(0 < entry["score"] < 1 for entry in last.tasks.values())  # outcomes that vary: the stderr is tested
    assert evaluator.zero_shot_adding(last, None, {t: [] for t in sizes}).tasks == last.tasks
