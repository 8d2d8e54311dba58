"""Recovery as a trial stage: after pruning and speed, before the evaluation, reporting its held-out loss curve; its
settings refused before Ray starts when they cannot work."""

import json

import pytest

from taylor_tune.config import PruneConfig, RecoverySpec
from taylor_tune.sources.world import heldout_path
from taylor_tune.sweep.experiment import Evaluation
from taylor_tune.sweep.trial import TrialConfig, run_trial
from tests.test_refused_before_work import experiment, nothing_started, one_line, run


def a_trial(recovery: RecoverySpec | None) -> TrialConfig:
    return TrialConfig(
        prune=PruneConfig(model="tiny-llama", method="taylor", sparsity=0.4, seq_len=32, num_samples=16,
                          calibration="world", device="cpu", dtype="float32"),
        evaluation=Evaluation(tasks="piqa", task_data="world", ppl="world", ppl_max_windows=8, batch_size=16,
                              fidelities=[20], speed=None),
        recovery=recovery,
    )


@pytest.mark.slow  # trains for seconds
def test_a_recovered_trial_reports_its_curve_between_pruning_and_evaluation_and_scores_the_recovered_model(tmp_path):
    spec = RecoverySpec(data="world", steps=30, lr=2e-3, warmup_steps=3, micro_batch_size=8, seq_len=64,
                        lora_dropout=0.0, eval_every=10, evaluate_before=True)
    reports = []
    recovered = run_trial(a_trial(spec), tmp_path / "r", report=lambda m: reports.append(dict(m)))
    plain = run_trial(a_trial(None), tmp_path / "p")
    assert [r["stage"] for r in reports] == ["pruned", "recovery_10", "recovery_20", "recovered", "ppl",
                                            "zero_shot_20"]
    curve = [r["recovery_heldout_loss"] for r in reports[1:4]]
    assert recovered["recovery_heldout_loss_after"] == curve[-1] < recovered["recovery_heldout_loss_before"]
    assert recovered["ppl"] < plain["ppl"]  # the evaluation scores the recovered model, on the same held-out text
    # evaluate_before: the pruned model's own evaluation, exactly what a trial without recovery measures
    assert recovered["before_recovery_ppl"] == plain["ppl"]
    assert recovered["before_recovery_acc_mean"] == plain["acc_mean"]
    assert recovered["before_recovery_acc_piqa_n"] == plain["acc_piqa_n"] == 20
    assert "before_recovery_acc_mean" in reports[1]  # known before the recovery's first point
    assert reports[3]["recovery_train_loss"] == pytest.approx(recovered["recovery_train_loss"])
    assert all(r["recovery_train_loss"] > 0 for r in reports[1:4])
    assert recovered["params_count"] == plain["params_count"]  # the merged adapters keep the pruned shapes
    record = json.loads((tmp_path / "r" / "config.json").read_text())
    assert record["recovery"]["steps"] == 30
    # a trial without recovery records exactly what it did before recovery existed (older sweeps resume as finished)
    assert "recovery" not in json.loads((tmp_path / "p" / "config.json").read_text())


@pytest.mark.parametrize("recovery, expected", [
    ({"loss": "mse"}, "recovery.loss: Input should be 'ce', 'kd' or 'ce+kd'"),
    ({"lora_rank": 0}, "recovery.lora_rank: Input should be greater than 0"),
    ({"steps": 0}, "recovery.steps"),
    ({"data": "/no/such/file.txt"}, "recovery.data: '/no/such/file.txt' is neither"),
    ({"data": str(heldout_path())}, "is held-out text the evaluation scores"),
])
def test_bad_recovery_settings_are_refused_before_ray_in_one_line(capsys, tmp_path, recovery, expected):
    code, _, err = run(capsys, "sweep", experiment(tmp_path, recovery=recovery))
    one_line(code, err, expected)
    nothing_started(tmp_path)


def test_recovery_on_the_real_world_text_needs_it_fetched(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TAYLOR_TUNE_HOME", str(tmp_path / "empty_home"))
    code, _, err = run(capsys, "sweep", experiment(tmp_path, recovery={"data": "wiki"}))
    one_line(code, err, "recovery.data:", "taylor-tune fetch wiki")
