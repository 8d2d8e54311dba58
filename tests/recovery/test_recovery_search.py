"""Recovery as part of the search: its settings are dimensions (validated before Ray starts), a trial is built from
the searched values, and ASHA decides at each point of the recovery's held-out loss curve before the zero-shot
passes."""

import pickle
import random
import statistics
from types import SimpleNamespace

import pytest

from taylor_tune.config import RecoverySpec
from taylor_tune.errors import ConfigError
from taylor_tune.sources.world import heldout_path
from taylor_tune.sweep.experiment import check_sources, load_experiment
from tests.test_refused_before_work import experiment, nothing_started, one_line, run

RECOVERY = {"data": "world", "steps": 20, "eval_every": 5}


@pytest.mark.parametrize("changes, expected", [
    ({"search_space.lora_rank": {"grid": [4, 8]}}, ("search_space.lora_rank searches a recovery setting, and the "
                                                    "experiment does not recover; add a recovery block",)),
    ({"recovery": {"lr": 1e-3}, "search_space.recovery_lr": {"grid": [1e-4, 1e-3]}},
     ("recovery.lr is also searched (search_space.recovery_lr)",)),
    ({"recovery": {}, "search_space.recovery_loss": {"grid": ["ce", "mse"]}},
     ("search_space.recovery_loss: Input should be 'ce', 'kd' or 'ce+kd' (got 'mse')",)),
    ({"recovery": {}, "search_space.lora_rank": {"grid": [0, 8]}},
     ("search_space.lora_rank: Input should be greater than 0 (got 0)",)),
    ({"recovery": {}, "search_space.recovery_steps": {"grid": [True]}},
     ("search_space.recovery_steps: Input should be a valid integer",)),
    ({"recovery": {}, "search_space.recovery_data": {"grid": ["world", str(heldout_path())]}},
     ("search_space.recovery_data:", "is held-out text the evaluation scores")),
    ({"recovery": {}, "search_space.recovery_data": {"grid": ["world", "/no/such.txt"]}},
     ("search_space.recovery_data: '/no/such.txt' is neither",)),
    ({"recovery": {}, "search_space.lora_rnak": {"grid": [4]}}, ("unknown dimension 'lora_rnak'", "lora_rank")),
], ids=["not-recovering", "fixed-and-searched", "unknown-loss", "rank-0", "bool-steps", "held-out-data",
        "missing-file", "misspelt"])
def test_bad_searched_recovery_settings_are_refused_before_ray_naming_the_dimension(capsys, tmp_path, changes,
                                                                                     expected):
    code, _, err = run(capsys, "sweep", experiment(tmp_path, **changes))
    one_line(code, err, *expected)
    nothing_started(tmp_path)


def test_a_trial_of_a_searched_recovery_is_the_recovery_block_with_the_point_s_values(tmp_path):
    from ray.tune.search.variant_generator import generate_variants

    from taylor_tune.sweep.tune.space import param_space
    from taylor_tune.sweep.tune.trainable import trial_config

    path = experiment(tmp_path, recovery={**RECOVERY, "lr": 5e-4},
                      **{"search_space.recovery_loss": {"grid": ["ce", "kd"]},
                         "search_space.lora_rank": {"grid": [4, 16]}})
    exp = load_experiment(path)
    assert exp.space_size() == 6 * 4 and exp.recovery_points() == 4  # 5, 10, 15 and the end (20)
    trials = [trial_config(v) for _, v in generate_variants(param_space(exp, str(tmp_path / "cache")))]
    assert len(trials) == 24
    got = {(t.prune.method, t.prune.seq_len, t.recovery.loss, t.recovery.lora_rank) for t in trials}
    assert got == {(m, s, loss, r) for m in ("taylor", "blockwise") for s in (16, 32, 48) for loss in ("ce", "kd")
                   for r in (4, 16)}
    # every other recovery setting is the block's (and its defaults), in every trial
    assert {(t.recovery.lr, t.recovery.steps, t.recovery.eval_every, t.recovery.data) for t in trials} == {
        (5e-4, 20, 5, "world")}
    assert all(t.record()["recovery"] == t.recovery.model_dump(mode="json") for t in trials)


def test_recovery_points_are_the_most_any_trial_reports():
    assert RecoverySpec(steps=20, eval_every=5).points == 4
    assert RecoverySpec(steps=21, eval_every=5).points == 5  # 5, 10, 15, 20 and the end (21)
    assert RecoverySpec(steps=20).points == 1  # the end only
    assert RecoverySpec(steps=1, eval_every=5).points == 1


def test_searched_recovery_data_is_checked_value_by_value(tmp_path, monkeypatch):
    monkeypatch.setenv("TAYLOR_TUNE_HOME", str(tmp_path / "empty_home"))  # wiki not fetched
    exp = load_experiment(experiment(tmp_path, recovery={}, **{"search_space.recovery_data":
                                                                {"grid": ["world", "wiki"]}}))
    with pytest.raises(ConfigError, match=r"^search_space.recovery_data: .*taylor-tune fetch wiki"):
        check_sources(exp)


def asha_reference(rungs: list[list[float]], reduction_factor: float) -> list[int]:
    """Successive halving as Ray's ASHA does it, on lower-is-better values: per rung, the values seen there so far;
    a trial stops where its value is above their 1/rf quantile (linear interpolation); the last rung always ends it.
    Returns, per trial (in order), the index of the rung it stopped at."""
    seen: dict[int, list[float]] = {}
    stopped = []
    for values in rungs:
        for k, value in enumerate(values):
            if k == len(values) - 1:
                stopped.append(k)
                break
            ranks = seen.setdefault(k, [])
            rewards = [-v for v in ranks]
            cut = None if not ranks else rewards[0] if len(ranks) == 1 else statistics.quantiles(
                rewards, n=reduction_factor, method="inclusive")[-1]
            ranks.append(value)
            if cut is not None and -value < cut:
                stopped.append(k)
                break
    return stopped


@pytest.mark.parametrize("mode", ["max", "min"])
def test_asha_decides_at_each_recovery_point_by_heldout_loss_then_at_each_pass_by_the_metric(mode):
    """Three recovery points then two zero-shot passes: the decisions equal successive halving on the held-out loss
    at the recovery rungs and on the metric at the cheap pass, whatever the metric's direction."""
    from taylor_tune.sweep.tune.scheduler import FidelityASHA

    metric = "acc_mean" if mode == "max" else "ppl"
    rf, points, passes = 2, 3, 2
    scheduler = FidelityASHA(passes, recovery_points=points, reduction_factor=rf, metric=metric, mode=mode)
    rng = random.Random(mode)
    curves, decided = [], []
    for n in range(40):
        trial = SimpleNamespace(trial_id=f"t{n}")
        scheduler.on_trial_add(None, trial)
        assert scheduler.on_trial_result(None, trial, {"stage": "pruned"}) == "CONTINUE"
        losses = sorted((rng.uniform(2, 4) for _ in range(points)), reverse=True)
        scores = [rng.uniform(0.3, 0.6) for _ in range(passes)]
        # the metric as lower-is-better, for the reference: the loss, then -acc (max) or ppl (min)
        curves.append(losses + [-s if mode == "max" else s for s in scores])
        stages = [{"stage": "recovery_5" if k < points - 1 else "recovered", "recovery_point": k + 1,
                   "recovery_heldout_loss": loss} for k, loss in enumerate(losses)]
        stages.insert(1, {"stage": "ppl", "recovery_point": 1, "recovery_heldout_loss": losses[0], "ppl": 9.0})
        stages += [{"stage": f"zero_shot_{k}", "zero_shot_pass": k, "recovery_point": points,
                    "recovery_heldout_loss": losses[-1], metric: s} for k, s in enumerate(scores)]
        rung = -1
        for result in stages:
            action = scheduler.on_trial_result(None, trial, dict(result))
            rung += result["stage"] != "ppl"  # the ppl between two points is no rung: never a decision
            if action == "STOP":
                break
        decided.append(rung)
        scheduler.on_trial_complete(None, trial, dict(result))
        if n == 20:  # pickled into Tune's experiment state and restored: it goes on the same
            scheduler = pickle.loads(pickle.dumps(scheduler))
    assert decided == asha_reference(curves, rf)
    assert {0, 1, 2, 3, 4} <= set(decided)  # trials stopped at every recovery rung and the pass; some finished
