"""A trial is its stages, run in order from one list (`trial.trial_stages`); the importance service is called once
per trial, and a cache hit draws no calibration."""

import dataclasses
import json

from taylor_tune.config import Evaluation, PruneConfig, SpeedSpec
from taylor_tune.pruning import prune as pruning_stages
from taylor_tune.pruning import scoring
from taylor_tune.sweep import trial as trial_module
from taylor_tune.sweep.trial import Stage, TrialConfig, run_trial

EXPECTED = ["start", "load", "score", "plan", "apply", "pruned", "speed", "evaluator", "ppl_0", "zero_shot_0",
            "zero_shot_1"]


def a_trial(cache_dir: str, method: str = "taylor") -> TrialConfig:
    speed = SpeedSpec(prefill_batch=1, prefill_len=8, decode_batch=2, prompt_len=4, new_tokens=2, context=64,
                      repeats=1, warmup=0)
    return TrialConfig(
        prune=PruneConfig(model="tiny-llama-random", method=method, seq_len=16, num_samples=4, calibration="world",
                          device="cpu", dtype="float32"),
        evaluation=Evaluation(tasks="piqa", task_data="world", ppl="world", ppl_max_windows=2, batch_size=8,
                              fidelities=[2, 4], speed=speed),
        sample_counts=(4, 8), cache_dir=cache_dir,
    )


def recorded(monkeypatch):
    """Every stage run, every call of the importance service and every calibration draw, in order."""
    seen = []
    listed = trial_module.trial_stages

    def stages(trial):
        return [dataclasses.replace(s, run=lambda run, s=s: seen.append(s.name) or s.run(run)) for s in listed(trial)]

    service, draw = pruning_stages.score_groups, scoring.draw_calibration
    monkeypatch.setattr(trial_module, "trial_stages", stages)
    monkeypatch.setattr(pruning_stages, "score_groups", lambda *a, **k: seen.append("service") or service(*a, **k))
    monkeypatch.setattr(scoring, "draw_calibration", lambda *a, **k: seen.append("draw") or draw(*a, **k))
    return seen


def test_a_trial_runs_its_stages_in_order_from_one_list_and_asks_the_service_once(tmp_path, monkeypatch):
    from taylor_tune.sweep.tune.scheduler import PASS

    seen, reports, passes = recorded(monkeypatch), [], []
    cache = str(tmp_path / "sweep" / "importance_cache")
    first = run_trial(a_trial(cache), tmp_path / "a",
                      report=lambda m: reports.append(m["stage"]) or passes.append(m.get(PASS)))
    # a miss: the service draws once (the largest sample count, inside the score stage) and computes
    assert seen == EXPECTED[:3] + ["service", "draw"] + EXPECTED[3:]
    assert reports == ["pruned", "speed", "ppl", "zero_shot_2", "zero_shot_4"]
    assert passes == [None, None, None, 0, 1]  # each zero-shot report's pass: the rung FidelityASHA counts it at
    assert first["importance_cache"] == "computed" and first["stage"] == "done"

    seen.clear()
    second = run_trial(a_trial(cache), tmp_path / "b")
    assert seen == EXPECTED[:3] + ["service"] + EXPECTED[3:]  # a hit: no calibration drawn anywhere
    assert second["importance_cache"] == "hit" and "calibration_s" not in second
    summary = lambda folder: json.loads((tmp_path / folder / "pruning_summary.json").read_text())["removed_groups"]
    assert summary("a") == summary("b")
    assert {k: first[k] for k in ("ppl", "acc_mean")} == {k: second[k] for k in ("ppl", "acc_mean")}


def test_a_stage_added_to_the_list_runs_in_its_place(tmp_path, monkeypatch):
    listed = trial_module.trial_stages
    planted = Stage("planted", lambda run: {"planted_params": run.pruning.diagnostics["params_count"]}, reports=True)

    def with_planted(trial):
        stages = listed(trial)
        return stages[:6] + [planted] + stages[6:]  # after the pruned report, before speed

    monkeypatch.setattr(trial_module, "trial_stages", with_planted)
    reports = []
    metrics = run_trial(a_trial(str(tmp_path / "cache"), method="magnitude"), tmp_path / "t", report=reports.append)
    assert [r["stage"] for r in reports][:2] == ["pruned", "pruned"]
    assert "planted_params" not in reports[0] and reports[1]["planted_params"] == metrics["params_count"]


def test_prune_runs_the_same_stage_functions_as_a_trial():
    assert pruning_stages.STAGES == (pruning_stages.load, pruning_stages.score, pruning_stages.plan,
                                     pruning_stages.apply)
    names = [s.name for s in trial_module.trial_stages(a_trial("x"))]
    assert names == EXPECTED
    # the trial's load/score/plan/apply stages wrap pruning's own functions, in pruning's order
    assert names[1:5] == [f.__name__ for f in pruning_stages.STAGES]


def test_prune_without_a_cache_draws_calibration_before_the_weights(monkeypatch):
    seen = []
    draw, load_model = scoring.draw_calibration, pruning_stages.load_model
    monkeypatch.setattr(scoring, "draw_calibration", lambda *a, **k: seen.append("draw") or draw(*a, **k))
    monkeypatch.setattr(pruning_stages, "load_model", lambda *a, **k: seen.append("weights") or load_model(*a, **k))
    result = pruning_stages.prune(PruneConfig(model="tiny-llama-random", seq_len=16, num_samples=4,
                                              calibration="world", device="cpu", dtype="float32"))
    assert seen == ["draw", "weights"] and result.calibration_ids.shape == (4, 16)
    assert result.timings["prune_s"] == result.timings["plan_s"] + result.timings["apply_s"]
