"""Recovery as a trial stage: after pruning and speed, before the evaluation, reporting its held-out loss curve; its
settings refused before Ray starts when they cannot work."""

import json

import pytest

from taylor_tune.config import Evaluation, PruneConfig, RecoverySpec
from taylor_tune.sources.recovery_data import instruction_batches, recovery_data
from taylor_tune.sources.world import heldout_path
from taylor_tune.sweep.trial import TrialConfig, run_trial
from tests.helpers import record_loads
from tests.test_refused_before_work import experiment, nothing_started, one_line, run


def a_trial(recovery: RecoverySpec | None, *, model: str = "tiny-llama", sparsity: float = 0.4, seq_len: int = 32,
            num_samples: int = 16, windows: int = 8, batch_size: int = 16, items: int = 20,
            ppl: str | None = "world", task_data: str = "world") -> TrialConfig:
    return TrialConfig(
        prune=PruneConfig(model=model, method="taylor", sparsity=sparsity, seq_len=seq_len, num_samples=num_samples,
                          calibration="world", device="cpu", dtype="float32"),
        evaluation=Evaluation(tasks="piqa", task_data=task_data, ppl=ppl, ppl_max_windows=windows,
                              batch_size=batch_size, fidelities=[items], speed=None),
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


def test_a_recovery_stage_reports_the_losses_of_the_models_it_trains_and_the_evaluation_scores_the_recovered_one(
        tmp_path, monkeypatch):
    """The recovery stage of a trial, fast (4 steps of a random tiny model) and against plain-torch recomputations:
    the held-out loss before is the pruned model's next-token cross-entropy on the held-out windows, after is the
    recovered model's (each reported with its perplexity, exp); the curve's point and the training-loss means are the
    steps' own losses averaged since the last point; the evaluation scores the recovered model; evaluate_before is
    exactly the evaluation of a trial without recovery; a kd recovery's teacher is the model as the trial loaded it.
    `auto` texts are the model's world (the recovery text, and the held-out text when the evaluation has none);
    instruction data's response mask reaches the training; every point reports its step, counted to the end."""
    import math
    import time

    import torch

    from taylor_tune import schema
    from taylor_tune.evaluation.evaluate import Evaluator
    from taylor_tune.pruning import prune as pruning_stages
    from taylor_tune.recovery import train as recovery_train
    from taylor_tune.sources.models import load_tokenizer
    from taylor_tune.sweep import trial as trial_module
    from tests.recovery.test_instructions import RECORDS

    seen, loads = {}, record_loads(monkeypatch, recovery_train, pruning_stages)
    recover = recovery_train.recover

    def spied(model, ids, held, spec, **kwargs):
        seen.update(held=held.clone(), teacher=kwargs.get("teacher"), mask=kwargs.get("mask"))
        seen["result"] = recover(model, ids, held, spec, **kwargs)
        return seen["result"]

    monkeypatch.setattr(recovery_train, "recover", spied)

    def a_tiny_trial(recovery: RecoverySpec | None, ppl: str | None = "auto") -> TrialConfig:  # random: untrained
        return a_trial(recovery, model="tiny-llama-random", sparsity=0.3, seq_len=16, num_samples=4, windows=2,
                       batch_size=8, items=4, ppl=ppl, task_data="auto")

    def cross_entropy(model, ids: torch.Tensor) -> float:  # every predicted token of every window weighs the same
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1]
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))

    spec = RecoverySpec(data="auto", steps=4, lr=5e-3, warmup_steps=1, micro_batch_size=2, seq_len=16,
                        lora_dropout=0.0, eval_every=2, heldout_windows=3, evaluate_before=True)
    reports, start = [], time.perf_counter()
    in_sweep = a_tiny_trial(spec).model_copy(update={"cache_dir": str(tmp_path / "sweep" / "importance_cache")})
    recovered = run_trial(in_sweep, tmp_path / "r", report=lambda m: reports.append(dict(m)))
    wall = time.perf_counter() - start
    result, held = seen["result"], seen["held"]
    assert seen["teacher"] is None and [name for name, _, _ in loads] == [pruning_stages.__name__]  # ce: no teacher
    assert [r["stage"] for r in reports] == ["pruned", "recovery_2", "recovered", "ppl", "zero_shot_4"]
    assert [r["recovery_point"] for r in reports[1:3]] == [1, 2]
    assert [r["recovery_step"] for r in reports[1:3]] == [2, 4]
    assert [s.name for s in trial_module.trial_stages(a_tiny_trial(spec))] == [
        "start", "load", "score", "plan", "apply", "pruned", "before_recovery", "recovery",
        "evaluator", "ppl_0", "zero_shot_0"]  # evaluated before, recovered, evaluated after
    assert json.loads((tmp_path / "r" / "config.json").read_text())["recovery"] == spec.model_dump(mode="json")
    settings = spec.model_dump()  # the recovery's settings are columns of its row, as a search varies them
    assert {c: recovered[c] for c in schema.RECOVERY_DIMENSIONS} == {
        c: settings[f] for c, f in schema.RECOVERY_DIMENSIONS.items()}

    pruned = pruning_stages.prune(a_tiny_trial(spec).prune).model  # the trial's pruned model, before recovery
    assert held.shape == (3, 16)
    assert recovered["recovery_heldout_loss_before"] == pytest.approx(cross_entropy(pruned, held), rel=1e-5)
    assert recovered["recovery_heldout_loss_after"] == pytest.approx(cross_entropy(result.model, held), rel=1e-5)
    assert recovered["recovery_heldout_loss"] == recovered["recovery_heldout_loss_after"]
    for when in ("before", "after"):
        assert recovered[f"recovery_heldout_ppl_{when}"] == pytest.approx(
            math.exp(recovered[f"recovery_heldout_loss_{when}"]), rel=1e-12)
    steps = result.train_loss
    assert len(steps) == 4 and all(loss > 0 for loss in steps)
    # `auto` recovery text: the world's draw; the first step trains the pruned model itself (LoRA's B = 0)
    tokenizer = load_tokenizer("tiny-llama-random")
    world = recovery_data(tokenizer, spec.model_copy(update={"data": "world"}), "tiny-llama-random")[0]
    assert steps[0] == pytest.approx(cross_entropy(pruned, world[:2]), rel=1e-5)
    assert reports[1]["recovery_heldout_loss"] == result.curve[1][1]
    assert reports[1]["recovery_train_loss"] == pytest.approx((steps[0] + steps[1]) / 2, rel=1e-12)
    assert recovered["recovery_train_loss"] == pytest.approx((steps[2] + steps[3]) / 2, rel=1e-12)
    assert recovered["recovery_train_loss_last"] == steps[3]
    assert recovered["recovery_s"] == result.seconds > 0

    evaluation = Evaluator(result.model, tokenizer,
                           a_tiny_trial(None).evaluation.spec(None), model_name="tiny-llama-random")
    assert recovered["ppl"] == pytest.approx(evaluation.perplexity().ppl, rel=1e-9)  # the recovered model's

    plain = run_trial(a_tiny_trial(None), tmp_path / "p")
    assert recovered["before_recovery_ppl"] == plain["ppl"] != recovered["ppl"]
    searchable = (*schema.CONFIG_COLUMNS, *schema.DIMENSIONS)  # beside the recovery's: the pruning's, as without it
    assert {c: recovered[c] for c in searchable} == {c: plain[c] for c in searchable}
    assert {k: recovered[f"before_recovery_{k}"] for k in ("acc_mean", "acc_piqa", "acc_piqa_stderr", "acc_piqa_n")} \
        == {k: plain[k] for k in ("acc_mean", "acc_piqa", "acc_piqa_stderr", "acc_piqa_n")}
    assert 0 < recovered["before_recovery_s"] < wall
    # in a sweep, the evaluation before recovery built the pass's requests into the sweep's cache; the one after read
    assert recovered["zero_shot_4_requests_built"] == 0 and plain["zero_shot_4_requests_built"] == 1

    loads.clear()
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    kd_spec = spec.model_copy(update={"loss": "kd", "evaluate_before": False, "data": str(alpaca), "eval_every": 1,
                                      "seq_len": 160})  # prompts: 154-228 tokens here
    reports.clear()
    # seed 1 and trust_remote_code on: the teacher must be loaded with the trial's own, not the defaults
    kd_trial = a_tiny_trial(kd_spec, ppl=None)
    kd_trial = kd_trial.model_copy(update={"prune": kd_trial.prune.model_copy(update={"seed": 1,
                                                                                      "trust_remote_code": True})})
    kd = run_trial(kd_trial, tmp_path / "kd", report=lambda m: reports.append(dict(m)))
    assert [r["stage"] for r in reports] == ["pruned", "recovery_1", "recovery_2", "recovery_3", "recovered",
                                            "zero_shot_4"]
    assert [(r["recovery_step"], r["recovery_point"]) for r in reports[1:5]] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    # no perplexity text: the held-out windows are the model's world's held-out text, as the first trial's
    assert torch.equal(seen["held"].flatten()[:held.numel()], held.flatten())
    responses = instruction_batches(tokenizer, RECORDS, kd_spec)[1]
    assert torch.equal(seen["mask"], responses) and 0 < int(responses.sum()) < responses.numel()
    teacher_load, pruned_load = sorted(loads, key=lambda load: load[0] != recovery_train.__name__)
    assert teacher_load[1:] == pruned_load[1:]  # the unpruned model, loaded as the trial's own
    assert (teacher_load[2]["seed"], teacher_load[2]["trust_remote_code"]) == (1, True)
    assert sum(p.numel() for p in seen["teacher"].parameters()) == kd["params_count_before"]
    assert not any(k.startswith("before_recovery") for k in kd)


def test_without_an_item_seed_the_evaluation_before_recovery_scores_the_last_pass_first_n_documents(tmp_path):
    """item_seed null: every pass scores lm-eval's first N documents (no item list), so the evaluation before
    recovery is bounded by the last fidelity itself, exactly as a trial without recovery scores."""
    spec = RecoverySpec(data="auto", steps=2, lr=5e-3, warmup_steps=1, micro_batch_size=2, seq_len=16,
                        lora_dropout=0.0, eval_every=2, heldout_windows=2, evaluate_before=True)

    def unseeded(recovery: RecoverySpec | None) -> TrialConfig:
        trial = a_trial(recovery, model="tiny-llama-random", sparsity=0.3, seq_len=16, num_samples=4, windows=2,
                        batch_size=8, items=4, ppl=None, task_data="auto")
        return trial.model_copy(update={"evaluation": trial.evaluation.model_copy(update={"item_seed": None})})

    recovered, plain = run_trial(unseeded(spec), tmp_path / "r"), run_trial(unseeded(None), tmp_path / "p")
    assert recovered["before_recovery_acc_piqa_n"] == plain["acc_piqa_n"] == 4
    assert recovered["before_recovery_acc_mean"] == plain["acc_mean"]
