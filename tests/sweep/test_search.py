"""The TPE searcher: each configuration at most once, repeats answered with the earlier result, resumable."""

import random
from itertools import product

import pytest

from taylor_tune.sweep.tune.search import ModelStudy, PerModelSearcher

PAPER = {"taylor_seq_len": [16, 32, 64, 128, 256], "taylor_num_samples": [128, 256, 512],
         "pruning_method": ["taylor", "layerwise", "blockwise"]}


def lookup(seed: int) -> dict[tuple, float]:
    rng = random.Random(seed)
    return {key: rng.random() for key in product(*PAPER.values())}


def key(params: dict) -> tuple:
    return tuple(params[name] for name in PAPER)


@pytest.mark.parametrize("table", [lookup(0), {k: 0.5 for k in lookup(0)}], ids=["varied", "constant"])
def test_a_study_hands_out_every_configuration_once_and_then_stops(table):
    study = ModelStudy(PAPER, seed=0, mode="max", n_startup_trials=5)
    handed = []
    while (params := study.ask()) is not None:
        handed.append(key(params))
        study.tell(params, table[key(params)])
    assert len(handed) == 45 and set(handed) == set(table)
    assert study.ask() is None
    # TPE did propose configurations again (else this test shows nothing); each repeat got the earlier result
    assert study.repeats_answered > 0
    complete = [t for t in study.study.trials if t.state.name == "COMPLETE"]
    for trial in complete:
        assert trial.value == table[key(trial.params)]
    assert len(complete) > 45  # the repeats were told to TPE, with the first run's value


def test_a_failed_configuration_is_not_run_again_and_teaches_tpe_nothing():
    study = ModelStudy(PAPER, seed=1, mode="max", n_startup_trials=3)
    first = study.ask()
    study.tell(first, None)
    rest = [key(p) for p in iter(study.ask, None)]
    assert key(first) not in rest and len(rest) == 44
    failed = [t for t in study.study.trials if t.state.name == "FAIL"]
    assert failed and all(t.value is None for t in failed)


def test_a_study_pickled_with_a_trial_running_resumes_without_repeating_it():
    import pickle

    space = {"taylor_seq_len": [16, 32], "taylor_num_samples": [8], "pruning_method": ["taylor"]}
    proposed_again = 0
    for seed in range(6):
        study = ModelStudy(space, seed=seed, mode="max", n_startup_trials=10)  # random phase: repeats are likely
        first = study.ask()
        restored = pickle.loads(pickle.dumps(study))  # what Tune's searcher checkpoint does mid-sweep
        second = restored.ask()
        assert second is not None and second != first
        proposed_again += restored.repeats_answered  # TPE proposed the running one: answered, not handed out
        assert restored.ask() is None
        restored.tell(first, 0.5)
        restored.tell(second, 0.7)
        assert sorted(t.value for t in restored.study.trials if t.state.name == "COMPLETE") == [0.5, 0.7]
    assert proposed_again > 0


def drive(searcher: PerModelSearcher, tables: dict, start: int, stop: int) -> list[tuple]:
    out = []
    for n in range(start, stop):
        config = searcher.suggest(f"t{n}")
        if config == PerModelSearcher.FINISHED:
            out.append("finished")
            break
        out.append((config["model"], key(config)))
        searcher.on_trial_complete(f"t{n}", {"acc_mean": tables[config["model"]][key(config)]})
    return out


def make_searcher() -> PerModelSearcher:
    return PerModelSearcher(
        ["a", "b"], PAPER, 6, {"prune": {}}, metric="acc_mean", mode="max", seed=3, n_startup_trials=2
    )


def test_the_searcher_gives_each_model_its_own_study_and_budget():
    tables = {"a": lookup(1), "b": {k: -v for k, v in lookup(1).items()}}
    searcher = make_searcher()
    handed = drive(searcher, tables, 0, 20)
    assert handed[-1] == "finished" and len(handed) == 13
    for model in ("a", "b"):
        keys = [k for m, k in handed[:-1] if m == model]
        assert len(keys) == len(set(keys)) == 6
        told = [t for t in searcher.studies[model].study.trials if t.state.name == "COMPLETE"]
        assert all(t.value == tables[model][key(t.params)] for t in told)  # results reached the study that asked
    assert [m for m, _ in handed[:-1]] == ["a", "b"] * 6


def test_a_restored_searcher_continues_exactly_as_an_uninterrupted_one(tmp_path):
    tables = {"a": lookup(2), "b": lookup(3)}
    whole = drive(make_searcher(), tables, 0, 20)
    first = make_searcher()
    head = drive(first, tables, 0, 5)
    first.save(str(tmp_path / "searcher.pkl"))
    second = make_searcher()
    second.restore(str(tmp_path / "searcher.pkl"))
    assert head + drive(second, tables, 5, 20) == whole


@pytest.mark.parametrize("reduction_factor", [2, 3])
def test_asha_decides_at_every_cheap_zero_shot_pass_as_successive_halving_does(reduction_factor):
    """Reference: per cheap pass, the scores seen there so far; a trial stops where its score is below their
    1 - 1/rf quantile (linear interpolation, as Ray's ASHA), and the last pass always ends the trial."""
    import pickle
    import statistics
    from types import SimpleNamespace

    from taylor_tune.sweep.tune.scheduler import FidelityASHA

    passes = 3
    scheduler = FidelityASHA(passes, reduction_factor=reduction_factor, metric="acc_mean", mode="max")
    rng = random.Random(reduction_factor)
    seen = {k: [] for k in range(passes - 1)}
    stops = {k: 0 for k in range(passes)}
    for n in range(60):
        trial = SimpleNamespace(trial_id=f"t{n}")
        scheduler.on_trial_add(None, trial)
        for early in ({"stage": "pruned"}, {"stage": "ppl", "ppl": 12.0}):  # no acc_mean yet: never scheduled
            assert scheduler.on_trial_result(None, trial, early) == "CONTINUE"
        for k in range(passes):
            score = rng.choice([0.5, 0.6, 0.7]) + rng.random() / 10
            action = scheduler.on_trial_result(
                None, trial, {"acc_mean": score, "zero_shot_pass": k, "stage": f"pass{k}"}
            )
            if k == passes - 1:
                expected = "STOP"  # the full evaluation: the trial is done
            else:
                ranks = seen[k]
                cut = (
                    (
                        ranks[0]
                        if len(ranks) == 1
                        else statistics.quantiles(ranks, n=reduction_factor, method="inclusive")[-1]
                    )
                    if ranks
                    else None
                )
                expected = "STOP" if cut is not None and score < cut else "CONTINUE"
                ranks.append(score)
            assert action == expected, (n, k)
            if action == "STOP":
                stops[k] += 1
                scheduler.on_trial_complete(None, trial, {"acc_mean": score, "zero_shot_pass": k})
                break
        if n == 30:  # Tune pickles the scheduler into the experiment state; a restored one goes on the same
            scheduler = pickle.loads(pickle.dumps(scheduler))
    assert stops[0] > 0 and stops[1] > 0 and stops[2] > 0  # both cheap passes stopped trials, and some finished
