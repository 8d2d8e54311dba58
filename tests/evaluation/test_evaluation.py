"""Evaluation on the offline world: the shipped models know their world, pruning costs them, numbers are exact."""

import json
import math

import pytest
import torch

from taylor_tune import schema
from taylor_tune.config import ZERO_SHOT_TASKS as TASKS
from taylor_tune.config import build_eval_spec, build_prune_config
from taylor_tune.errors import ConfigError, EvaluationError
from taylor_tune.evaluation.evaluate import evaluate
from taylor_tune.evaluation.perplexity import perplexity
from taylor_tune.evaluation.zero_shot import TASK_YAML, offline_task_config
from taylor_tune.pruning.prune import prune
from taylor_tune.sources.data import TRAINED_MODELS, load_ppl_text
from taylor_tune.sources.models import load_model, load_tokenizer
from taylor_tune.sources.world import heldout_path, task_file

CHANCE = {
    "boolq": 0.5,
    "piqa": 0.5,
    "winogrande": 0.5,
    "hellaswag": 0.25,
    "arc_easy": 0.25,
    "arc_challenge": 0.25,
    "openbookqa": 0.25,
}


def world_spec(**kw):
    return build_eval_spec({"task_data": "world", "ppl": "world", **kw})


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED_MODELS)
def test_shipped_models_beat_chance_and_know_their_text(name):
    model, tokenizer = load_model(name), load_tokenizer(name)
    result = evaluate(model, tokenizer, world_spec(), model_name=name)
    assert result["task_data"] == "world"
    beaten = [t for t, e in result["tasks"].items() if e["score"] - CHANCE[t] > 2 * e["score_stderr"]]
    assert len(beaten) >= 5, {t: (e["score"], e["score_stderr"]) for t, e in result["tasks"].items()}
    assert all(e["n"] >= 100 for e in result["tasks"].values())
    assert result["ppl"] < len(tokenizer) / 50  # a uniform guess would score the vocabulary size
    assert result["acc_mean"] == pytest.approx(sum(result[f"acc_{t}"] for t in TASKS) / 7)
    for task, e in result["tasks"].items():  # the two halves (held-out selection) recombine into lm-eval's own score
        assert e["n_sel"] + e["n_heldout"] == e["n"] and abs(e["n_sel"] - e["n_heldout"]) <= 1
        assert (e["n_sel"] * e["score_sel"] + e["n_heldout"] * e["score_heldout"]) / e["n"] == pytest.approx(
            e["score"]
        ), task


def prune_tiny_llama(method, sparsity):
    return prune(
        build_prune_config(
            {
                "model": "tiny-llama",
                "method": method,
                "sparsity": sparsity,
                "calibration": "world",
                "seq_len": 64,
                "num_samples": 128,
                "device": "cpu",
            }
        )
    )


@pytest.mark.slow
def test_pruning_the_tiny_llama_costs_perplexity_and_random_costs_more():
    text = load_ppl_text("world")
    ppl = lambda model, tok: perplexity(model, tok, text)["ppl"]
    base = ppl(load_model("tiny-llama"), load_tokenizer("tiny-llama"))
    taylor20, taylor50, random20 = (
        prune_tiny_llama(m, s) for m, s in (("taylor", 0.2), ("taylor", 0.5), ("random", 0.2))
    )
    p20, p50, r20 = (ppl(r.model, r.tokenizer) for r in (taylor20, taylor50, random20))
    assert base < p20 < p50
    assert r20 > p20


@pytest.mark.slow
def test_in_memory_evaluation_equals_the_saved_and_reloaded_model(tmp_path):
    from taylor_tune.pruning.artifacts import write_prune_artifacts

    config = build_prune_config(
        {
            "model": "tiny-qwen2",
            "method": "blockwise",
            "sparsity": 0.3,
            "calibration": "world",
            "seq_len": 32,
            "num_samples": 16,
            "device": "cpu",
            "blockwise_attention": "closest_ratio",
        }
    )
    result = prune(config)
    spec = build_eval_spec({"ppl": "world", "tasks": "piqa,hellaswag,arc_challenge", "limit": 60})  # task_data: auto
    in_memory = evaluate(result.model, result.tokenizer, spec, model_name="tiny-qwen2")
    write_prune_artifacts(tmp_path, config, result)
    folder = str(tmp_path / "model")
    reloaded = evaluate(load_model(folder), load_tokenizer(folder), spec, model_name=folder)
    drop = lambda r: {k: v for k, v in r.items() if not k.endswith(schema.SECONDS_SUFFIX)}  # timings
    assert drop(in_memory) == drop(reloaded)
    assert (
        in_memory["task_data"] == reloaded["task_data"] == "world"
    )  # a pruned tiny model is still evaluated on its world


@pytest.mark.slow
def test_one_lm_eval_call_for_all_tasks_scores_each_as_its_own_call_would():
    from taylor_tune.evaluation.scorer import make_lm
    from taylor_tune.evaluation.zero_shot import zero_shot

    lm = make_lm(load_model("tiny-mistral"), load_tokenizer("tiny-mistral"), 16)
    together, seconds, _ = zero_shot(lm, world_spec(limit=30, ppl=None), "world")
    assert set(together) == set(TASKS) and seconds > 0
    for task in TASKS:
        alone, _, _ = zero_shot(lm, world_spec(limit=30, ppl=None, tasks=task), "world")
        assert together[task] == alone[task], task


@pytest.mark.slow
@pytest.mark.parametrize("window", [16, 128])
def test_perplexity_equals_a_plain_loop_over_windows(window):
    model, tok = load_model("tiny-mistral"), load_tokenizer("tiny-mistral")
    text = heldout_path().read_text()[:20000]
    ours = perplexity(model, tok, text, window=window, batch_size=7)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    losses = []
    with torch.no_grad():
        for start in range(0, len(ids) - window + 1, window):
            chunk = torch.tensor([ids[start : start + window]])
            losses.append(model(input_ids=chunk, labels=chunk).loss.item())  # mean over window - 1 tokens
    assert ours["ppl_windows"] == len(losses) and ours["ppl_window"] == window
    assert ours["ppl"] == pytest.approx(math.exp(sum(losses) / len(losses)), rel=1e-4)


def test_perplexity_of_chosen_windows_is_the_plain_loops_and_passes_added_together_give_the_whole_text():
    """`select` scores the listed windows (their NLL as a plain loop over those windows computes it); two passes over
    disjoint windows added together (`PerplexityResult.adding`) give every window's perplexity, its windows once each,
    the curve's last point the perplexity."""
    from taylor_tune.evaluation.evaluate import Evaluator

    model, tok = load_model("tiny-llama"), load_tokenizer("tiny-llama")
    window, select = 32, [9, 2, 7]
    text = heldout_path().read_text()[:8000]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    chosen = perplexity(model, tok, text, window=window, max_windows=12, select=select)
    with torch.no_grad():
        loop = [model(input_ids=torch.tensor([ids[w * window: (w + 1) * window]]),
                      labels=torch.tensor([ids[w * window: (w + 1) * window]])).loss.item() * (window - 1)
                for w in select]
    assert chosen["window_ids"] == select and chosen["ppl_windows"] == 3
    assert chosen["window_nll"] == pytest.approx(loop, rel=1e-5)
    with pytest.raises(EvaluationError, match="not among the text's 12"):
        perplexity(model, tok, text, window=window, max_windows=12, select=[12])

    evaluator = Evaluator(model, tok, world_spec(ppl_window=window, ppl_max_windows=12), model_name="tiny-llama")
    whole, first = evaluator.perplexity(), evaluator.perplexity([5, 0, 11])
    both = first.adding(evaluator.perplexity([w for w in range(12) if w not in (5, 0, 11)]))
    assert evaluator.ppl_windows() == whole.windows == both.windows == 12 and sorted(both.ids()) == list(range(12))
    assert both.ppl == pytest.approx(whole.ppl, rel=1e-6) and both.tokens == whole.tokens
    assert both.curve[-1] == [12, pytest.approx(both.ppl, rel=1e-12)] and both.ids()[:3] == [5, 0, 11]


def test_offline_tasks_keep_lm_evals_own_definitions():
    import lm_eval.tasks.hellaswag.utils as hellaswag_utils

    config = offline_task_config("hellaswag", task_file("hellaswag"))
    ours, theirs = config["process_docs"].__code__, hellaswag_utils.process_docs.__code__
    # lm-eval imports a task's utils by file path, so the module object may differ from the package's: same code
    assert (ours.co_filename, ours.co_firstlineno, ours.co_code) == (
        theirs.co_filename,
        theirs.co_firstlineno,
        theirs.co_code,
    )
    assert config["doc_to_text"] == "{{query}}" and config["dataset_path"] == "json"
    wino = offline_task_config("winogrande", task_file("winogrande"))
    assert callable(wino["doc_to_choice"]) and wino["doc_to_choice"].__module__.endswith("preprocess_winogrande")
    arc = offline_task_config("arc_challenge", task_file("arc_challenge"))
    assert arc["test_split"] == "test" and "test" in arc["dataset_kwargs"]["data_files"]


@pytest.mark.slow
def test_task_yaml_paths_are_where_lm_eval_keeps_them():
    # Private lm-eval layout (pinned 0.4.13; the index's `_entry`): this fails loudly if an upgrade moves a task.
    from pathlib import Path

    from lm_eval.tasks import TaskManager

    from taylor_tune.evaluation.zero_shot import _lm_eval_tasks_dir

    manager = TaskManager()
    for task, relative in TASK_YAML.items():
        assert Path(manager._entry(task).yaml_path).resolve() == (_lm_eval_tasks_dir() / relative).resolve(), task


def test_the_world_data_regenerates_byte_for_byte(tmp_path):
    from scripts.world.generate import write_world_data
    from taylor_tune.sources.world import world_dir

    write_world_data(tmp_path)
    for name in ["corpus.txt", "heldout.txt"] + [f"tasks/{t}.jsonl" for t in TASKS]:
        assert (tmp_path / name).read_bytes() == (world_dir() / name).read_bytes(), name


def test_task_files_use_the_real_schemas():
    keys = {
        "boolq": {"passage", "question", "label"}, "piqa": {"goal", "sol1", "sol2", "label"},
        "hellaswag": {"ctx_a", "ctx_b", "ctx", "activity_label", "endings", "label"},
        "winogrande": {"sentence", "option1", "option2", "answer"}, "arc_easy": {"question", "choices", "answerKey"},
        "arc_challenge": {"question", "choices", "answerKey"}, "openbookqa": {"question_stem", "choices", "answerKey"},
    }
    for task in TASKS:
        items = [json.loads(line) for line in task_file(task).read_text().splitlines()]
        assert len(items) >= 100 and all(keys[task] <= set(item) for item in items), task


@pytest.mark.parametrize("values, message", [
    ({"tasks": "boolq,squad"}, "tasks: unknown task 'squad'"),
    ({"limit": 0}, "limit: Input should be greater than 0"),
])
def test_bad_specs_name_the_field(values, message):
    with pytest.raises(ConfigError, match=message):
        build_eval_spec(values)


@pytest.mark.parametrize("values, message", [
    ({"task_data": "EMPTY"}, "task_data: .* has no boolq.jsonl"),
    ({"task_data": "/no/such/dir"}, "task_data: '/no/such/dir' is neither"),
    ({"ppl": "missing.txt"}, "ppl: 'missing.txt' is neither"),
])
def test_what_a_spec_names_is_checked_to_exist_as_a_step_of_its_own(values, message, tmp_path):
    from taylor_tune.sources.data import check_eval_sources

    values = {k: (str(tmp_path) if v == "EMPTY" else v) for k, v in values.items()}
    spec = build_eval_spec(values)  # validation reads no file: the spec is valid wherever it is built
    with pytest.raises(ConfigError, match=message):
        check_eval_sources(spec)


def test_a_window_longer_than_the_model_is_refused():
    with pytest.raises(EvaluationError, match="ppl_window: 1024 is longer than the model's maximum context of 512"):
        evaluate(load_model("tiny-llama"), load_tokenizer("tiny-llama"), world_spec(ppl_window=1024, tasks=[]))


def test_a_failure_inside_a_task_names_the_task(tmp_path):
    for task in TASKS:
        (tmp_path / f"{task}.jsonl").write_text(task_file(task).read_text())
    (tmp_path / "piqa.jsonl").write_text(json.dumps({"goal": "no solutions here", "label": 0}) + "\n")
    spec = build_eval_spec({"task_data": str(tmp_path), "tasks": "boolq,piqa", "ppl": None, "limit": 5})
    with pytest.raises(EvaluationError, match=r"^task piqa: "):
        evaluate(load_model("tiny-llama"), load_tokenizer("tiny-llama"), spec)


def test_wikitext2_goes_through_the_datasets_loader_and_fails_clearly_offline():
    with pytest.raises(Exception, match="ppl: cannot load dataset 'wikitext'"):
        load_ppl_text("wikitext2")


@pytest.mark.slow  # a process that runs lm-eval
def test_outside_a_git_checkout_zero_shot_prints_no_git_error_and_records_versions(tmp_path):
    """Issue 27, finding 15: lm-eval's environment record ran `git describe` in the working directory (`fatal: not a
    git repository` in every trial's log outside a checkout) and torch's collect_env on every call."""
    import subprocess
    import sys

    out = tmp_path / "e.json"
    run = subprocess.run([sys.executable, "-m", "taylor_tune", "evaluate", "--model", "tiny-llama", "--tasks", "piqa",
                          "--limit", "8", "--ppl", "none", "--output", str(out)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "not a git repository" not in run.stderr + run.stdout
    assert json.loads(out.read_text())["acc_piqa_n"] == 8

    from lm_eval import evaluator

    from taylor_tune.compat.lm_eval import without_environment_record

    record = {}
    with without_environment_record():
        evaluator.add_env_info(record)
        assert evaluator.get_git_commit_hash() is None
    assert set(record) == {"lm_eval_version", "transformers_version"}
    assert evaluator.add_env_info.__module__ == "lm_eval.loggers.utils"  # lm-eval's own again outside


def test_a_window_of_exactly_the_maximum_context_is_scored_and_one_more_refused():
    from types import SimpleNamespace

    from tests.helpers import tiny

    model, tokenizer = tiny("tiny-llama-random"), load_tokenizer("tiny-llama-random")
    limit = model.config.max_position_embeddings
    text = load_ppl_text("world")
    full = perplexity(model, tokenizer, text, window=limit, max_windows=1)
    assert full["ppl_window"] == limit and full["ppl_windows"] == 1 and math.isfinite(full["ppl"])
    with pytest.raises(EvaluationError, match=f"ppl_window: {limit + 1} is longer than the model's maximum context"):
        perplexity(model, tokenizer, text, window=limit + 1, max_windows=1)
    from taylor_tune.evaluation.perplexity import check_window

    check_window(10**6, SimpleNamespace())  # a config that states no maximum context is not checked
