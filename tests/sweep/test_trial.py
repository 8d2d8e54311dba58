"""One trial without Ray: what it reports, with and without the shared importance cache."""

import json

import pytest

from taylor_tune.config import Evaluation, PruneConfig
from taylor_tune.storage.cache import Store
from taylor_tune.sweep.trial import TrialConfig, run_trial


def trial(num_samples: int, cache_dir=None) -> TrialConfig:
    return TrialConfig(
        prune=PruneConfig(model="tiny-llama", method="taylor", seq_len=32, num_samples=num_samples, calibration="world",
                          device="cpu", dtype="float32"),
        evaluation=Evaluation(tasks="piqa", task_data="world", ppl=None, batch_size=16, fidelities=[4]),
        sample_counts=(8, 16), cache_dir=cache_dir,
    )


@pytest.mark.slow
def test_a_cached_pass_serves_the_next_trial_and_each_reports_its_own_stages(tmp_path):
    cache = str(tmp_path / "cache")
    first = run_trial(trial(16, cache), tmp_path / "a")  # a miss: draws 16 sequences, computes, stores 8 and 16
    second = run_trial(trial(8, cache), tmp_path / "b")   # a hit: no draw
    alone = run_trial(trial(8), tmp_path / "c")           # no cache: its own draw of 8
    assert (first["importance_cache"], second["importance_cache"]) == ("computed", "hit")
    assert "importance_cache" not in alone
    assert first["calibration_s"] > 0 and alone["calibration_s"] > 0 and "calibration_s" not in second
    assert all(m["importance_s"] > 0 for m in (first, second, alone))
    assert first["scorer"] == "prefix" and first["zero_shot_4_tokens"] > 0
    # the cached 8-sample scores are the nested draw's: the same plan as computing 8 alone
    plan = lambda folder: json.loads((tmp_path / folder / "pruning_summary.json").read_text())["removed_groups"]
    assert plan("b") == plan("c")


def test_a_sweeps_evaluation_is_an_evalspec_with_passes_and_keeps_its_metric_overrides(tmp_path):
    import pytest
    from pydantic import ValidationError

    from taylor_tune.config import EvalSpec

    evaluation = Evaluation(
        tasks="piqa,arc_easy", task_data="world", ppl=None, metrics={"piqa": "acc_norm"}, fidelities=[5]
    )
    assert (
        isinstance(evaluation, EvalSpec)
        and evaluation.spec(5).limit == 5
        and evaluation.spec(5).metrics == {"piqa": "acc_norm"}
    )
    with pytest.raises(ValidationError, match="fidelities"):
        Evaluation(limit=5)
    config = trial(8).model_copy(update={"evaluation": evaluation})
    metrics = run_trial(config, tmp_path / "t")
    tasks = json.loads((tmp_path / "t" / "evaluation.json").read_text())["tasks"]
    assert tasks["piqa"]["metric"] == "acc_norm" and metrics["acc_piqa"] == tasks["piqa"]["acc_norm"]
    assert tasks["arc_easy"]["metric"] == "acc" and metrics["acc_arc_easy"] == tasks["arc_easy"]["acc"]


def test_an_importance_entry_serves_only_the_dtype_and_device_it_was_computed_in(tmp_path):
    """A sweep resumed on other hardware must not read the importance of a float32 CPU pass into a bfloat16 GPU
    trial: the key holds the dtype and device type the model was loaded in, not the config's `auto`."""
    import torch

    from taylor_tune.pruning.groups import describe_layout
    from taylor_tune.pruning.importance_cache import ImportanceCache
    from taylor_tune.pruning.scoring import Calibration, importance_fields, score_groups
    from taylor_tune.sources.models import load_tokenizer
    from tests.helpers import tiny

    config = PruneConfig(model="tiny-llama-random", method="taylor", seq_len=16, num_samples=4, calibration="world",
                         device="cpu", dtype="auto")
    cache_dir = tmp_path / "cache"
    model, tokenizer = tiny("tiny-llama-random"), load_tokenizer("tiny-llama-random")
    layout = describe_layout(model)

    def event(model) -> str:
        cache = ImportanceCache(cache_dir)
        return score_groups(model, layout, Calibration(config, tokenizer), cache=cache).cache_event

    events = [event(model) for _ in range(2)] + [event(model.to(torch.bfloat16))]
    assert events == ["computed", "hit", "computed"]

    cpu, cuda = (importance_fields(config, dtype=torch.float32, device=torch.device(d)) for d in ("cpu", "cuda:1"))
    assert cpu["device"] == "cpu" and cuda["device"] == "cuda" and cpu["dtype"] == "float32"
    assert (
        importance_fields(config, dtype=torch.float32, device=torch.device("cuda:0")) == cuda
    )  # the type, not the index
    asked = []
    ImportanceCache(cache_dir).get_or_compute(cuda, [4], lambda: asked.append("cuda") or {})
    assert asked == ["cuda"]  # the CPU entry of the same model, draw and dtype was not served


@pytest.mark.parametrize("changed", ["model", "calibration", "seq_len", "seed", "dtype", "device"])
def test_the_importance_key_changes_with_each_field_the_pass_depends_on(changed):
    import torch

    from taylor_tune.pruning.importance_cache import cache_key
    from taylor_tune.pruning.scoring import importance_fields

    base = dict(model="tiny-llama", method="taylor", seq_len=32, num_samples=8, calibration="world", seed=0)
    runtime = dict(dtype=torch.float32, device=torch.device("cpu"))
    other = {"model": "tiny-qwen2", "calibration": "sample", "seq_len": 64, "seed": 1}
    config_change = {changed: other[changed]} if changed in other else {}
    runtime_change = {"dtype": {"dtype": torch.bfloat16}, "device": {"device": torch.device("cuda")}}.get(changed, {})
    key = lambda config, at: cache_key(**importance_fields(PruneConfig(**config), **at), counts=[8])
    # one entry serves every method and sample count
    assert key(base, runtime) == key(dict(base, method="blockwise", num_samples=4), runtime)
    assert key(base, runtime) != key(base | config_change, runtime | runtime_change)


def test_a_damaged_cache_entry_is_removed_and_computed_again_once(tmp_path):
    import numpy as np

    from taylor_tune.pruning.importance import Importance
    from taylor_tune.pruning.importance_cache import ImportanceCache, cache_key
    from taylor_tune.pruning.plan import GroupScores

    def compute():
        computed.append(1)
        scores = GroupScores(attn=(np.array([1.0, 2.0]),), mlp=(np.array([3.0, 4.0, 5.0]),))
        return {4: Importance(4, scores, np.array([0.1]), np.array([0.2]))}

    computed, fields = [], {"model": "m", "seq_len": 8}
    cache = ImportanceCache(tmp_path)
    first = cache.get_or_compute(fields, [4], compute)
    entry = tmp_path / f"{cache_key(**fields, counts=[4])}.safetensors"
    entry.write_bytes(entry.read_bytes()[:40])  # cut short, as a full disk or an interrupted copy leaves it
    again = cache.get_or_compute(fields, [4], compute)
    assert len(computed) == 2 and np.array_equal(again[4].scores.mlp[0], first[4].scores.mlp[0])
    assert cache.get_or_compute(fields, [4], compute)[4].num_samples == 4 and len(computed) == 2  # a hit now
    events = [event["event"] for event in Store(tmp_path).events()]
    assert events == ["computed", "damaged", "computed", "hit"]


def test_a_trial_measures_speed_and_memory_against_the_unpruned_model_timed_beside_it(tmp_path):
    """Issues 28 and 64: every trial reports its speedups, each with its paired interval, and its memory ratio; the
    unpruned model is timed in the trial's own window (not once per sweep); a uniform 40% model holds less memory
    than the unpruned one."""
    from taylor_tune.config import SpeedSpec

    speed = SpeedSpec(prefill_batch=2, prefill_len=32, decode_batch=4, prompt_len=8, new_tokens=4, context=256,
                      repeats=3, warmup=1)
    cache = str(tmp_path / "sweep" / "importance_cache")
    base = trial(8, cache)
    evaluation = base.evaluation.model_copy(update={"speed": speed})
    first = run_trial(base.model_copy(update={"evaluation": evaluation}), tmp_path / "a")
    uniform = base.prune.model_copy(update={"uniform": True, "sparsity": 0.4})
    second = run_trial(base.model_copy(update={"evaluation": evaluation, "prune": uniform}), tmp_path / "b")
    for metrics in (first, second):
        for key in ("prefill_speedup", "decode_speedup", "decode_batch_speedup", "memory_ratio", "prefill_tokens_per_s",
                    "unpruned_decode_tokens_per_s", "speed_s", "weight_bytes", "kv_cache_bytes"):
            assert metrics[key] > 0, key
        for speedup in ("prefill_speedup", "decode_speedup", "decode_batch_speedup"):  # evaluation/speed.py
            assert metrics[f"{speedup}_low"] <= metrics[speedup] <= metrics[f"{speedup}_high"]
            assert metrics[f"{speedup}_se"] >= 0
        assert metrics["speed_pairs"] == 3 and metrics["speed_reused"] is False  # each timed its own pairs
    unpruned = [k for k in first if k.startswith("unpruned_")]
    assert len(unpruned) == 8  # 3 rates with their _se, 2 sizes
    assert all(first[k] == second[k] for k in ("unpruned_weight_bytes", "unpruned_kv_cache_bytes"))
    assert len(list((tmp_path / "sweep" / "paired_speed").glob("*.json"))) == 2  # two shapes, two records
    total = lambda m, prefix="": m[f"{prefix}weight_bytes"] + m[f"{prefix}kv_cache_bytes"]
    assert second["memory_ratio"] == pytest.approx(total(second) / total(second, "unpruned_"))
    assert total(second) < total(second, "unpruned_")
    saved = json.loads((tmp_path / "b" / "evaluation.json").read_text())  # what status and the report read
    assert saved["decode_speedup"] == second["decode_speedup"] and saved["memory_ratio"] == second["memory_ratio"]


def test_kv_cache_bytes_equal_what_transformers_cache_holds():
    import torch

    from taylor_tune.evaluation.speed import kv_cache_bytes
    from taylor_tune.sources.models import load_model
    from tests.pruning.test_apply import pruned

    for model in (load_model("tiny-qwen2-random"), pruned("tiny-qwen2-random", "taylor", 0.3).model):
        with torch.no_grad():
            cache = model(input_ids=torch.zeros(1, 37, dtype=torch.long), use_cache=True).past_key_values
        held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        assert kv_cache_bytes(model, 37) == held


def test_a_trials_stored_outcomes_average_to_its_reported_accuracies_exactly(tmp_path):
    """Issue 64, must-show 1 (tiny models): every zero-shot pass writes each item's outcome; read back (as the report
    reads them) and averaged per task in the task's metric, they are the reported acc_<task>, and their mean of task
    means acc_mean. Both fidelities' files, the first a subset of the second's items."""
    from taylor_tune.storage.folder import read_outcomes

    evaluation = Evaluation(tasks="piqa,arc_easy,boolq", task_data="world", ppl=None, metrics={"piqa": "acc_norm"},
                            fidelities=[3, 7], speed=None)
    metrics = run_trial(trial(8).model_copy(update={"evaluation": evaluation}), tmp_path / "t")
    first, last = (read_outcomes(str(tmp_path / "t"), stage) for stage in ("zero_shot_3", "zero_shot_7"))
    assert read_outcomes(str(tmp_path / "t"), "zero_shot_5") is None
    assert len(first) == 3 * 3 and len(last) == 3 * 7 and set(first.index) < set(last.index)
    means = {task: last.xs(task)["acc_norm" if task == "piqa" else "acc"].mean() for task in ("piqa", "arc_easy",
                                                                                             "boolq")}
    assert {task: metrics[f"acc_{task}"] for task in means} == means  # exactly: the same items, the same mean
    assert metrics["acc_mean"] == sum(means.values()) / 3
    assert last.xs("boolq")["acc_norm"].isna().all() and set(last.columns) == {"acc", "acc_norm"}


def test_a_trials_stored_perplexity_windows_give_its_reported_ppl_exactly(tmp_path):
    """Issue 64, must-show 1 (perplexity): each window's summed NLL, stored in the trial's folder, gives the reported
    ppl as exp(their sum / their tokens) exactly, and ppl_windows windows of ppl_window - 1 tokens each."""
    import math

    import pyarrow.parquet as pq

    evaluation = Evaluation(tasks="piqa", task_data="world", ppl="world", ppl_max_windows=5, fidelities=[3],
                            speed=None)
    metrics = run_trial(trial(8).model_copy(update={"evaluation": evaluation}), tmp_path / "t")
    windows = pq.read_table(tmp_path / "t" / "ppl_windows.parquet").to_pandas()
    assert len(windows) == metrics["ppl_windows"] == 5 and (windows["tokens"] == metrics["ppl_window"] - 1).all()
    assert math.exp(math.fsum(windows["nll"]) / windows["tokens"].sum()) == metrics["ppl"]


@pytest.mark.real
@pytest.mark.slow
def test_a_real_trials_stored_outcomes_give_its_reported_accuracies_and_ppl_exactly(tmp_path, assets):
    """Issue 64, must-show 1 on real SmolLM2-135M and the seven real tasks: each task's stored item outcomes,
    averaged in the task's metric, are its reported acc_<task>, their mean of task means acc_mean, and the stored
    windows of the held-out Wikipedia text give its ppl, all exactly."""
    import math

    import pyarrow.parquet as pq

    from taylor_tune.storage.folder import read_outcomes

    evaluation = Evaluation(tasks="all", task_data="real", ppl="wiki", ppl_window=128, ppl_max_windows=4,
                            fidelities=[8], speed=None)
    config = TrialConfig(prune=PruneConfig(model="smollm2-135m", method="magnitude", sparsity=0.2, device="cpu",
                                           dtype="float32"), evaluation=evaluation)
    metrics = run_trial(config, tmp_path / "t")
    items = read_outcomes(str(tmp_path / "t"), "zero_shot_8")
    tasks = evaluation.tasks
    assert len(tasks) == 7 and len(items) == 7 * 8
    means = {task: items.xs(task)[evaluation.metric(task)].mean() for task in tasks}
    assert {task: metrics[f"acc_{task}"] for task in tasks} == means
    assert metrics["acc_mean"] == sum(means.values()) / 7
    windows = pq.read_table(tmp_path / "t" / "ppl_windows.parquet").to_pandas()
    assert len(windows) == metrics["ppl_windows"] == 4
    assert math.exp(math.fsum(windows["nll"]) / windows["tokens"].sum()) == metrics["ppl"]


def test_a_trials_passes_score_the_models_seeded_items_and_a_stored_trial_without_a_seed_the_first_n(tmp_path):
    """item_seed (issue 66): each pass of N items scores the first N of each task in the model's seeded order, the
    same for any trial of the model, each pass's items a superset of the one before; a trial stored before item_seed
    existed (its evaluation lacks the field) scores lm-eval's first N documents and records what it recorded then."""
    import numpy as np

    from taylor_tune.storage.folder import read_outcomes
    from taylor_tune.sweep.racing import race_seed
    from taylor_tune.sweep.tune.trainable import trial_config

    evaluation = Evaluation(tasks="piqa,arc_easy", task_data="world", ppl=None, batch_size=16, fidelities=[6, 15],
                            speed=None)
    seeded = trial(8).model_copy(update={"evaluation": evaluation})
    run_trial(seeded, tmp_path / "seeded")
    items = {stage: read_outcomes(str(tmp_path / "seeded"), stage).index for stage in ("zero_shot_6", "zero_shot_15")}
    # the order written out: numpy's permutation of each task's 200 items (the world's), tasks in sorted order
    rng = np.random.default_rng(race_seed(0, "tiny-llama"))
    order = {task: rng.permutation(200) for task in ("arc_easy", "piqa")}
    for stage, n in (("zero_shot_6", 6), ("zero_shot_15", 15)):
        expected = sorted((task, int(doc)) for task, docs in order.items() for doc in docs[:n])
        assert sorted(items[stage]) == expected
    assert set(items["zero_shot_6"]) < set(items["zero_shot_15"])

    stored = {"fixed": {"prune": {"method": "taylor", "seq_len": 32, "num_samples": 8, "calibration": "world",
                                  "device": "cpu", "dtype": "float32"},
                        "evaluation": evaluation.model_dump(exclude={"item_seed"}), "sample_counts": [8, 16],
                        "cache_dir": None},
              "model": "tiny-llama", "seed": 0}
    old = trial_config(stored)
    assert old.evaluation.item_seed is None and "item_seed" not in old.record()["evaluation"]
    assert old.record()["evaluation"] == {k: v for k, v in seeded.record()["evaluation"].items() if k != "item_seed"}
    run_trial(old, tmp_path / "old")
    first = read_outcomes(str(tmp_path / "old"), "zero_shot_6").index
    assert sorted(first) == sorted((task, doc) for task in ("arc_easy", "piqa") for doc in range(6))
