"""Racing on shared items through Ray (issue 66, must-show 2): a grid raced on seeded blocks stops trials after a
cheap pass, each stop checked against a paired test written out here on the outcomes the trials left in their
folders, and the best trial is scored on every item."""

import json
from pathlib import Path
from statistics import NormalDist

import pandas as pd
import pytest

from taylor_tune.reporting import load_trials
from taylor_tune.storage.folder import read_outcomes, read_ppl_windows
from taylor_tune.storage.names import RACE_FILE
from tests.sweep_helpers import analysis_rows, run_sweep_to_end, write_experiment

pytestmark = pytest.mark.slow  # a Ray sweep

TASKS = ("piqa", "arc_easy", "hellaswag")
ALPHA = 0.45  # a loose level, so that tiny random models (all near chance) separate on a few hundred items


def scores(folder: str, stage: str) -> pd.Series:
    """Each item's score in its task's default metric (acc for PIQA and ARC-e, acc_norm for HellaSwag)."""
    outcomes = read_outcomes(folder, stage)
    return pd.concat([outcomes.loc[[t]]["acc_norm" if t == "hellaswag" else "acc"] for t in TASKS])


def written_out_test(trial: pd.Series, incumbent: pd.Series) -> tuple[float, float]:
    """The paired difference trial - incumbent on the trial's items: the mean over tasks of each task's mean
    difference, its standard error from each task's sample variance (tasks independent)."""
    both = pd.DataFrame({"t": trial, "i": incumbent.loc[trial.index]})
    per_task = [(g["t"] - g["i"]) for _, g in both.groupby(level=0)]
    difference = sum(d.mean() for d in per_task) / len(per_task)
    stderr = sum(d.var(ddof=1) / len(d) for d in per_task) ** 0.5 / len(per_task)
    return difference, stderr


def stop_reasons(folder) -> dict[str, str]:
    """The report's reason for each trial it leaves out of the statistics."""
    table = load_trials(folder)
    return dict(zip(table.invalid["trial_id"], table.invalid["reason"]))


# six trials raced on three blocks of the three tasks, one at a time (so that the race sees them in the grid's order)
RACED_GRID = dict(
    search_space={"taylor_seq_len": {"grid": [16, 32, 48]}, "taylor_num_samples": {"grid": [8]},
                  "pruning_method": {"grid": ["taylor", "blockwise"]}},
    search={"algorithm": "grid", "scheduler": "race", "alpha": ALPHA, "max_concurrent": 1},
    evaluation={"tasks": ",".join(TASKS), "task_data": "world", "ppl": None, "batch_size": 16,
                "fidelities": [20, 60, None], "speed": None},
)


@pytest.fixture(scope="module")
def raced_grid(tmp_path_factory, ray_head) -> Path:
    """The raced grid run to its end once, uninterrupted: checked by the first test, the reference of the killed
    one (which only reads it)."""
    root = tmp_path_factory.mktemp("raced-grid")
    run_sweep_to_end(write_experiment(root, "race", **RACED_GRID), cluster=ray_head)
    return root / "sweeps" / "race"


def test_a_raced_grid_stops_trials_by_a_paired_test_and_its_best_is_scored_on_every_item(raced_grid):
    folder = raced_grid
    rows = {r["trial_id"]: r for r in analysis_rows(folder)}
    race = json.loads((folder / RACE_FILE).read_text())
    assert len(rows) == 6 and set(race["trials"]) == set(rows)

    # every trial's first pass scored the same 20 items of each task, a seeded sample (not the first 20 documents)
    first = {tid: scores(r["output_dir"], "zero_shot_20").index for tid, r in rows.items()}
    shared = next(iter(first.values()))
    assert all(index.equals(shared) for index in first.values())
    assert all(len(shared[shared.get_level_values(0) == t]) == 20 for t in TASKS)
    assert sorted(shared[shared.get_level_values(0) == "piqa"].get_level_values(1)) != list(range(20))

    stopped = {tid: r for tid, r in rows.items() if r["stage"] != "zero_shot_all"}
    assert stopped, "a race at alpha 0.45 over six near-chance trials stops some"
    z = NormalDist().inv_cdf(1 - ALPHA)
    for tid, row in stopped.items():
        decision = next(d for d in reversed(race["decisions"]["tiny-llama"]) if d["trial"] == tid)
        assert not decision["go_on"] and decision["block"] == row["zero_shot_pass"]
        incumbent = race["trials"][decision["incumbent"]]
        mine = scores(row["output_dir"], row["stage"])
        theirs = scores(rows[decision["incumbent"]]["output_dir"], incumbent["stage"])
        difference, stderr = written_out_test(mine, theirs)
        assert difference < 0 and difference + z * stderr < 0  # worse at one-sided level alpha
        assert decision["difference"] == pytest.approx(difference, abs=1e-12)
        assert decision["stderr"] == pytest.approx(stderr, abs=1e-12)

    finished = {tid: r for tid, r in rows.items() if r["stage"] == "zero_shot_all"}
    best = max(finished.values(), key=lambda r: r["acc_mean"])
    assert all(best[f"acc_{t}_n"] == 200 for t in TASKS)  # every item of each task (the world's 200)
    assert len(scores(best["output_dir"], "zero_shot_all")) == 3 * 200

    # the report says why each stopped trial stopped, on how many items
    reasons = stop_reasons(folder)
    assert set(reasons) == set(stopped)
    for tid, row in stopped.items():
        assert reasons[tid].startswith(f"incomplete: evaluated on {int(row['fidelity'])} items per task")
        assert "raced out at block" in reasons[tid] and ", paired" in reasons[tid]


def test_a_grid_raced_on_ppl_stops_trials_after_a_perplexity_pass_and_its_best_scores_every_window(tmp_path, ray_head):
    """metric ppl: the race decides after each perplexity pass (seeded windows), each stop checked against the paired
    log-perplexity test written out here on the windows the trials left; a stopped trial never reaches its zero-shot
    pass; the best is scored on every window; the report says why each stopped."""
    experiment = write_experiment(
        tmp_path, "ppl-race", metric="ppl", mode="min",
        search_space={"taylor_seq_len": {"grid": [16, 32, 48]}, "taylor_num_samples": {"grid": [8]},
                      "pruning_method": {"grid": ["taylor", "blockwise"]}},
        search={"algorithm": "grid", "scheduler": "race", "alpha": ALPHA, "max_concurrent": 1},
        evaluation={"tasks": "piqa", "task_data": "world", "ppl": "world", "ppl_window": 32, "ppl_max_windows": 48,
                    "ppl_fidelities": [6, 16, None], "batch_size": 16, "fidelities": [20], "speed": None},
    )
    run_sweep_to_end(experiment, cluster=ray_head)
    folder = tmp_path / "sweeps" / "ppl-race"
    rows = {r["trial_id"]: r for r in analysis_rows(folder)}
    race = json.loads((folder / RACE_FILE).read_text())
    assert len(rows) == 6 and set(race["trials"]) == set(rows) and race["objective"] == "ppl"

    stopped = {tid: r for tid, r in rows.items() if race["trials"][tid]["stopped"]}
    assert stopped, "a race at alpha 0.45 over six trials stops some"
    z = NormalDist().inv_cdf(1 - ALPHA)
    for tid, row in stopped.items():
        assert row["stage"].startswith("ppl_") and pd.isna(row.get("acc_mean"))  # out before its zero-shot pass
        decision = next(d for d in reversed(race["decisions"]["tiny-llama"]) if d["trial"] == tid)
        assert not decision["go_on"] and decision["block"] == row["ppl_pass"]
        mine = read_ppl_windows(row["output_dir"])
        theirs = read_ppl_windows(rows[decision["incumbent"]]["output_dir"]).loc[mine.index]
        d = theirs["nll"] - mine["nll"]  # incumbent minus trial: < 0 when the trial is worse
        difference = d.sum() / mine["tokens"].sum()
        stderr = (((d - difference * mine["tokens"]) ** 2).sum() * len(d) / (len(d) - 1)) ** 0.5 / mine["tokens"].sum()
        assert len(mine) == row["ppl_windows"] < 48 and difference < 0 and difference + z * stderr < 0
        assert decision["difference"] == pytest.approx(difference, abs=1e-12)
        assert decision["stderr"] == pytest.approx(stderr, abs=1e-12)

    finished = [r for tid, r in rows.items() if tid not in stopped]
    best = min(finished, key=lambda r: r["ppl"])
    assert best["ppl_windows"] == 48 and best["stage"] == "zero_shot_20"
    assert len(read_ppl_windows(best["output_dir"])) == 48

    reasons = stop_reasons(folder)
    assert set(reasons) == set(stopped)
    for tid, row in stopped.items():
        assert reasons[tid].startswith(f"incomplete: perplexity on {int(row['ppl_windows'])} windows, not every window")
        assert "raced out at block" in reasons[tid] and "in log ppl, paired" in reasons[tid]


def canonical_race(folder) -> dict:
    """The race's state and the report's reasons with each trial named by its configuration (trial ids are new in
    every run of a sweep), the paths left out."""
    name = {r["trial_id"]: f"{r['pruning_method']}/{r['taylor_seq_len']}" for r in analysis_rows(folder)}

    def named(value):
        if isinstance(value, str):
            for trial_id, configuration in name.items():
                value = value.replace(trial_id, configuration)
        return value

    race = json.loads((folder / RACE_FILE).read_text())
    trials = {named(t): {k: named(v) for k, v in entry.items() if k != "folder"} for t, entry in race["trials"].items()}
    decisions = [{k: named(v) for k, v in d.items()} for d in race["decisions"]["tiny-llama"]]
    return {"trials": trials, "decisions": decisions,
            "reasons": {named(t): named(why) for t, why in stop_reasons(folder).items()}}


def test_a_race_killed_and_resumed_keeps_every_decision_of_an_uninterrupted_run(tmp_path, raced_grid):
    """Issue 80: after a SIGKILL and a resume of a racing sweep, the race's state held only its pre-kill decisions
    (Tune's restore puts back its copy of every .json at the top of the folder) and the report fell back to 'stopped
    early by the scheduler'. Now: the race's state and the report's reasons equal an uninterrupted run's."""
    import signal

    from tests.sweep.test_sweep_resilience import interrupt_sweep

    reference = canonical_race(raced_grid)
    killed = write_experiment(tmp_path, "killed", **RACED_GRID)
    folder = tmp_path / "sweeps" / "killed"

    def raced(count: int) -> bool:
        try:
            return len(json.loads((folder / RACE_FILE).read_text())["trials"]) >= count
        except (OSError, ValueError):
            return False

    interrupt_sweep(killed, tmp_path / "first-run.log", lambda: raced(3), signal.SIGKILL, TAYLOR_TUNE_TEST_SLOW="1")
    before = json.loads((folder / RACE_FILE).read_text())
    assert 3 <= len(before["trials"]) < 6, "the sweep must be killed part-way for this test to mean anything"
    run_sweep_to_end(killed)
    assert canonical_race(folder) == reference
    assert not any("stopped early by the scheduler" in why for why in stop_reasons(folder).values())
