"""The racing scheduler's side of Tune (issue 66): it reads each pass's outcomes from the trial's folder, stops a trial
exactly when the paired test written out in test_racing rejects, never stops a trial at its last pass, and a driver
resumed mid-sweep (Tune restores the scheduler as it was pickled at the start) decides as an uninterrupted one."""

import json
import os
import pickle
from statistics import NormalDist
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from ray.tune.schedulers import TrialScheduler

from taylor_tune.schema import zero_shot_stage
from taylor_tune.storage.names import PPL_WINDOWS_FILE, RACE_FILE, outcomes_file
from taylor_tune.sweep.racing import Blocks, race_seed
from taylor_tune.sweep.tune.scheduler import RaceScheduler
from tests.sweep.test_racing import TASKS, reference, scores, worse_copy

FIDELITIES = (20, 50, 100, None)
EVALUATION = {"tasks": ",".join(TASKS), "task_data": "world", "ppl": None, "fidelities": list(FIDELITIES)}
BLOCKS = Blocks.plan(TASKS, (20, 50, 100, 101), seed=race_seed(0, "tiny-llama"))


def trial(trial_id: str) -> SimpleNamespace:
    return SimpleNamespace(trial_id=trial_id, config={"model": "tiny-llama", "fixed": {"evaluation": EVALUATION}})


def pass_result(folder, values: dict[str, np.ndarray], block: int) -> dict:
    """What the trainable leaves and reports after pass `block`: the items' outcomes in the trial's folder (acc and
    acc_norm both the item's 0/1, as for the world's tasks' metrics here), then the result."""
    stage = zero_shot_stage(FIDELITIES[block])
    rows = [(task, doc, float(values[task][doc])) for task, ids in BLOCKS.items(block).items() for doc in ids]
    frame = pd.DataFrame(rows, columns=["task", "doc_id", "acc"]).assign(acc_norm=lambda f: f["acc"])
    folder.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(folder / outcomes_file(stage))
    result = {"zero_shot_pass": block, "stage": stage, "output_dir": str(folder)}
    with open(folder / "result.json", "a") as log:  # the report Tune records: each task's accuracy on these items
        log.write(json.dumps(result | {f"acc_{task}": float(np.mean([values[task][d] for d in ids]))
                                       for task, ids in BLOCKS.items(block).items()}) + "\n")
    return result


def race(scheduler_of, root, trials: dict[str, dict], order: list[tuple[str, int]]) -> list[tuple[str, int, str]]:
    """Feed the results in `order` ((trial, block) pairs), none of a trial after it was stopped (Tune ends it);
    `scheduler_of(step)` is the scheduler at each step. Returns (trial, block, what the scheduler said)."""
    said, stopped = [], set()
    for step, (name, block) in enumerate(order):
        if name in stopped:
            continue
        result = pass_result(root / name, trials[name], block)
        word = scheduler_of(step).on_trial_result(None, trial(name), result)
        said.append((name, block, word))
        if word == TrialScheduler.STOP:
            stopped.add(name)
    return said


def test_the_scheduler_stops_a_trial_when_the_written_out_test_rejects_and_resumes_as_it_was(tmp_path):
    rng = np.random.default_rng(5)
    best = scores(rng, 0.7)
    trials = {"a": best, "b": worse_copy(rng, best, lose=0.10, gain=0.02), "c": worse_copy(rng, best, 0.01, 0.01)}
    order = [("a", 0), ("a", 1), ("a", 2), ("a", 3)] + [(t, b) for b in range(4) for t in ("b", "c")]

    whole = RaceScheduler(str(tmp_path / "one"), alpha=0.05)
    said = race(lambda step: whole, tmp_path / "one", trials, order)

    # the reference: a trial goes on until the written-out test against the leader (a, every item) rejects
    for name, block, word in said:
        if name != "a":
            worse = reference(trials[name], best, BLOCKS.items(block))[2]
            assert word == (TrialScheduler.STOP if worse and block < 3 else TrialScheduler.CONTINUE), (name, block)
    stopped = {name: block for name, block, word in said if word == TrialScheduler.STOP}
    assert list(stopped) == ["b"] and stopped["b"] < 3  # 10% of its right answers lost: out early; c ties, goes on

    # race.json: what the report reads (the stopped trial's line) and what a resumed driver reads back
    saved = json.loads((tmp_path / "one" / RACE_FILE).read_text())
    assert saved["trials"]["b"]["why"].startswith("raced out at block 1, worse than a by ")
    assert saved["trials"]["c"]["final"] and saved["trials"]["a"]["final"]

    # a driver killed after 6 results: Tune restores the scheduler pickled at the start (empty), which reads
    # race.json and the trials' outcomes back; and a scheduler pickled mid-sweep goes on from its own state
    (tmp_path / "two").mkdir()
    start = pickle.dumps(RaceScheduler(str(tmp_path / "two"), alpha=0.05))
    before, restored = pickle.loads(start), pickle.loads(start)
    later = []

    def resumed(step: int) -> RaceScheduler:
        if step < 6:
            return before
        if step < 9:
            return restored
        if not later:
            later.append(pickle.loads(pickle.dumps(restored)))
        return later[0]

    assert race(resumed, tmp_path / "two", trials, order) == said
    assert json.loads((tmp_path / "two" / RACE_FILE).read_text())["decisions"] == saved["decisions"]


PPL_FIDELITIES = (8, 16, 32, None)
PPL_EVALUATION = {"tasks": "piqa", "task_data": "world", "ppl": "world", "ppl_fidelities": list(PPL_FIDELITIES),
                  "fidelities": [None]}
WINDOWS = Blocks.plan({"ppl": 64}, (8, 16, 32, 33), seed=race_seed(0, "tiny-llama"))


def ppl_pass_result(folder, nll: np.ndarray, tokens: np.ndarray, block: int) -> dict:
    """What the trainable leaves and reports after perplexity pass `block`: every window scored so far (in the order
    scored) in the trial's folder, then the result."""
    ids = WINDOWS.items(block)["ppl"]
    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"window": ids, "nll": nll[ids], "tokens": tokens[ids]}).to_parquet(folder / PPL_WINDOWS_FILE)
    stage = "ppl" if block == len(PPL_FIDELITIES) - 1 else f"ppl_{len(ids)}"
    return {"ppl_pass": block, "stage": stage, "output_dir": str(folder)}


def test_a_race_on_ppl_stops_a_trial_after_a_perplexity_pass_by_the_written_out_window_test(tmp_path):
    """metric ppl: the scheduler decides after each perplexity pass on the windows scored so far (the seeded blocks),
    by the paired log-perplexity difference written out here; a zero-shot result after the passes (which carries the
    last ppl_pass) decides nothing; a scheduler restored from its start reads each trial's windows of its recorded
    pass back, not the ones a later pass added."""
    rng = np.random.default_rng(8)
    tokens = rng.integers(100, 128, 64).astype(float)
    nll = {"a": tokens * rng.normal(3.0, 0.3, 64)}
    nll["b"] = nll["a"] + tokens * rng.normal(0.05, 0.05, 64)  # 5% worse log ppl per token, noisy: out early
    nll["c"] = nll["a"] + tokens * rng.normal(0.0, 0.05, 64)  # ties
    z = NormalDist().inv_cdf(1 - 0.05)

    def ppl_trial(name):
        return SimpleNamespace(trial_id=name, config={"model": "tiny-llama", "fixed": {"evaluation": PPL_EVALUATION}})

    scheduler = RaceScheduler(str(tmp_path), alpha=0.05, objective="ppl")
    for block in range(4):
        assert scheduler.on_trial_result(None, ppl_trial("a"), ppl_pass_result(tmp_path / "a", nll["a"], tokens,
                                                                              block)) == TrialScheduler.CONTINUE
    said = {}
    for block in range(4):
        for name in ("b", "c"):
            if said.get(name) == TrialScheduler.STOP:
                continue
            word = scheduler.on_trial_result(None, ppl_trial(name), ppl_pass_result(tmp_path / name, nll[name],
                                                                                   tokens, block))
            ids = WINDOWS.items(block)["ppl"]
            d = nll["a"][ids] - nll[name][ids]  # incumbent minus trial: < 0 when the trial is worse
            difference = d.sum() / tokens[ids].sum()
            stderr = (((d - difference * tokens[ids]) ** 2).sum() * len(d) / (len(d) - 1)) ** 0.5 / tokens[ids].sum()
            decision = scheduler.races["tiny-llama"].decisions[-1]
            assert (decision.trial, decision.items) == (name, len(ids))
            assert decision.difference == pytest.approx(difference, rel=1e-9)
            assert decision.stderr == pytest.approx(stderr, rel=1e-9)
            rejects = difference < 0 and -difference > z * stderr
            said[name] = word
            assert word == (TrialScheduler.STOP if rejects and block < 3 else TrialScheduler.CONTINUE), (name, block)
    assert said == {"b": TrialScheduler.STOP, "c": TrialScheduler.CONTINUE}
    stopped = json.loads((tmp_path / RACE_FILE).read_text())["trials"]["b"]
    assert stopped["stopped"] and stopped["why"].startswith(f"raced out at block {stopped['block'] + 1}, worse than a")
    assert "in log ppl" in stopped["why"] and stopped["items"] == len(WINDOWS.items(stopped["block"])["ppl"])

    decisions = len(scheduler.races["tiny-llama"].decisions)
    zero_shot = {"ppl_pass": 3, "zero_shot_pass": 0, "stage": "zero_shot_all", "output_dir": str(tmp_path / "c")}
    assert scheduler.on_trial_result(None, ppl_trial("c"), zero_shot) == TrialScheduler.CONTINUE
    assert len(scheduler.races["tiny-llama"].decisions) == decisions

    ppl_pass_result(tmp_path / "b", nll["b"], tokens, 3)  # b's folder now holds more windows than its recorded pass
    restored = RaceScheduler(str(tmp_path), alpha=0.05, objective="ppl")
    restored._load()
    for name in "abc":
        pd.testing.assert_frame_equal(restored.races["tiny-llama"].outcomes[name],
                                      scheduler.races["tiny-llama"].outcomes[name])
    assert restored.races["tiny-llama"].decisions == scheduler.races["tiny-llama"].decisions


def test_a_resumed_race_refuses_items_that_no_longer_give_what_the_trial_reported(tmp_path, caplog):
    """Issue 80: an incumbent's outcomes edited between a kill and the resume made the race stop the grid's real best.
    Now the race's state is checked before Ray starts (`folder.check_race_state`, what `sweep` runs): one line naming
    the file, whether the trial's result.json says otherwise or (a result.json a second behind the race's state) the
    digest the race recorded of the items does; a scheduler that meets such a file anyway leaves the trial out."""
    from taylor_tune.errors import ConfigError
    from taylor_tune.sweep.folder import check_race_state

    rng = np.random.default_rng(5)
    best = scores(rng, 0.7)
    trials = {"a": best, "b": worse_copy(rng, best, lose=0.10, gain=0.02), "c": worse_copy(rng, best, 0.01, 0.01)}
    order = [("a", 0), ("a", 1), ("a", 2), ("a", 3)] + [(t, b) for b in range(4) for t in ("b", "c")]
    scheduler = RaceScheduler(str(tmp_path))
    race(lambda step: scheduler, tmp_path, trials, order)
    check_race_state(str(tmp_path))  # as written: resumes

    outcomes = tmp_path / "a" / outcomes_file(zero_shot_stage(None))
    kept = outcomes.read_bytes()
    frame = pd.read_parquet(outcomes)
    frame.loc[frame.index[:40], ["acc", "acc_norm"]] = 0.0  # the incumbent made worse
    frame.to_parquet(outcomes)
    with pytest.raises(ConfigError, match=rf"^{outcomes}: trial a's items do not give the accuracies it reported at "
                                          r"zero_shot_all; restore the file"):
        check_race_state(str(tmp_path))
    report = (tmp_path / "a" / "result.json").read_text()
    (tmp_path / "a" / "result.json").write_text("\n".join(report.splitlines()[:-1]) + "\n")  # a second behind
    with pytest.raises(ConfigError, match=rf"^{outcomes}: trial a's items do not give the items the race recorded"):
        check_race_state(str(tmp_path))
    resumed = RaceScheduler(str(tmp_path))
    resumed.on_trial_result(None, trial("d"), pass_result(tmp_path / "d", trials["c"], 0))
    assert "a" not in resumed.trials and "a" not in resumed.races["tiny-llama"].outcomes
    assert "trial a's items do not give the items the race recorded; restore the file" in caplog.text and \
        "left out of the race" in caplog.text
    outcomes.write_bytes(kept)
    (tmp_path / "a" / "result.json").write_text(report)
    check_race_state(str(tmp_path))  # put back: resumes again


@pytest.mark.parametrize("edit", ["missing key", "not JSON", "link at the temporary name"])
def test_a_race_state_missing_a_key_or_cut_short_is_one_line_and_a_link_is_never_written_through(tmp_path, edit):
    """Issue 80: a race state missing a key gave three tracebacks and exit 1; a link planted at its temporary name
    led the race to write through it, outside the sweep. Now: one line naming the file and the key before Ray starts,
    and the state is written as a file of its own whatever lies at its names."""
    from taylor_tune.errors import ConfigError
    from taylor_tune.sweep.folder import check_race_state

    rng = np.random.default_rng(5)
    trials = {"a": scores(rng, 0.7)}
    scheduler = RaceScheduler(str(tmp_path))
    race(lambda step: scheduler, tmp_path, trials, [("a", 0)])
    state = tmp_path / RACE_FILE
    if edit == "link at the temporary name":
        outside = tmp_path.parent / f"{tmp_path.name}-outside.txt"
        outside.write_text("not the race's")
        for name in (f"{state.name}.tmp", f".{state.name}.{os.getpid()}.tmp"):
            (state.parent / name).symlink_to(outside)
        race(lambda step: scheduler, tmp_path, trials, [("a", 1)])
        assert outside.read_text() == "not the race's" and not state.is_symlink()
        assert json.loads(state.read_text())["trials"]["a"]["block"] == 1
        return
    saved = json.loads(state.read_text())
    if edit == "missing key":
        del saved["trials"]["a"]["folder"]
        state.write_text(json.dumps(saved))
        message = rf"^{state}: trial a's folder is missing$"
    else:
        state.write_text(json.dumps(saved)[:-20])
        message = rf"^{state}: not JSON \(cut short or damaged\)$"
    with pytest.raises(ConfigError, match=message):
        check_race_state(str(tmp_path))


def test_a_race_never_reads_or_writes_its_state_through_a_linked_folder(tmp_path):
    """Issue 91, case 3: the sweep's `taylor_tune/` folder made a link to a folder outside it: a fresh race wrote
    race.json there (the link check covered the file and its temporary name, not a linked parent). Now the driver
    refuses it in one line before Ray starts, and the scheduler neither writes through it nor reads what lies there."""
    from taylor_tune.errors import ConfigError
    from taylor_tune.reporting.frame import read_experiment
    from taylor_tune.sweep.folder import check_race_state

    outside = tmp_path / "outside"
    outside.mkdir()
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / RACE_FILE).parent.symlink_to(outside)
    linked = sweep / RACE_FILE.split("/")[0]
    with pytest.raises(ConfigError, match=rf"^{linked} is a symbolic link, and a racing sweep keeps its state there"):
        check_race_state(str(sweep))
    rng = np.random.default_rng(5)
    with pytest.raises(OSError, match=rf"{linked} is a symbolic link, and .* would be written through it"):
        race(lambda step: RaceScheduler(str(sweep)), sweep, {"a": scores(rng, 0.7)}, [("a", 0)])
    assert list(outside.iterdir()) == []  # nothing written outside the sweep

    planted = {"alpha": 0.05, "objective": "acc_mean", "trials": {"a": {"why": "planted"}}, "decisions": {}}
    (outside / "race.json").write_text(json.dumps(planted))  # what lies behind the link is never read as the race's
    (sweep / "a" / "params.json").write_text(json.dumps({"model": "tiny-llama"}))
    assert "race" not in read_experiment(str(sweep)).columns
    resumed = RaceScheduler(str(sweep))
    resumed._load()
    assert resumed.trials == {} and resumed.races == {}
