"""bench/bench_race.py (issue 66, must-show 3) on a constructed grid kept as a sweep keeps it: the band is the written-
out paired test's, the grid's cost the sum of what its trials spent, and a race's cost what its trials' blocks
scored, its pick in the band."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import bench_race  # noqa: E402

TASKS = {"piqa": 120, "arc_easy": 100}
EVALUATION = {"tasks": list(TASKS), "task_data": "world", "ppl": None, "fidelities": [None]}
KEYS = [(16, 8, "taylor"), (32, 8, "taylor"), (16, 8, "blockwise"), (32, 8, "blockwise"), (16, 8, "layerwise"),
        (32, 8, "layerwise")]
ACCURACY = {KEYS[0]: 0.80, KEYS[1]: 0.79, KEYS[2]: 0.45, KEYS[3]: 0.40, KEYS[4]: 0.55, KEYS[5]: 0.50}


def write_grid(root: Path, doc_id=lambda task, i: i) -> dict:
    """A trial folder per configuration: params.json, result.json (its seconds) and the outcomes of every item (item
    i of a task kept under `doc_id(task, i)`)."""
    rng = np.random.default_rng(0)
    base = {t: rng.random(n) for t, n in TASKS.items()}  # one difficulty per item, shared: outcomes correlate
    truth = {}
    for n, key in enumerate(KEYS):
        folder = root / f"sweep_trainable_x_{n:05d}"
        folder.mkdir(parents=True)
        rows = [(t, doc_id(t, i), float(base[t][i] < ACCURACY[key]), np.nan) for t, size in TASKS.items()
                for i in range(size)]
        outcomes = pd.DataFrame(rows, columns=["task", "doc_id", "acc", "acc_norm"])
        outcomes.to_parquet(folder / "outcomes_zero_shot_all.parquet")
        (folder / "params.json").write_text(json.dumps({"fixed": {"evaluation": EVALUATION}, "model": "m", "seed": 0,
                                                        **dict(zip(bench_race.NAMES, key))}))
        result = {"taylor_seq_len": key[0], "taylor_num_samples": key[1], "pruning_method": key[2], "load_s": 1.0,
                  "prune_s": 2.0 + n, "stage": "zero_shot_all", "zero_shot_all_s": 22.0,
                  **({"importance_cache": "computed", "importance_s": 30.0} if key[1:] == (8, "taylor") else {})}
        (folder / "result.json").write_text(json.dumps(result) + "\n")
        truth[key] = pd.Series([r[2] for r in rows], index=pd.MultiIndex.from_tuples([r[:2] for r in rows]))
    return truth


def test_the_replay_prices_what_trials_spent_and_races_to_a_pick_in_the_band(tmp_path):
    truth = write_grid(tmp_path)
    data = bench_race.load_grid(tmp_path)
    assert data["item_s"] == 22.0 / 220 and data["importance"] == {(16, "gradients"): 30.0, (32, "gradients"): 30.0}
    assert data["names"] == bench_race.NAMES

    # the band written out: not separated from the best by the task-stratified paired test at 95%, two-sided
    means = {k: np.mean([s.loc[t].mean() for t in TASKS]) for k, s in truth.items()}
    best = max(means, key=means.get)
    tied = set()
    for key, scores in truth.items():
        d = [(scores.loc[t] - truth[best].loc[t]) for t in TASKS]
        se = np.sqrt(sum(x.var(ddof=1) / len(x) for x in d)) / len(TASKS)
        if key == best or abs(np.mean([x.mean() for x in d])) <= 1.959963984540054 * se:
            tied.add(key)
    assert bench_race.band(data["configs"]) == (best, tied) and tied == {KEYS[0], KEYS[1]}

    args = SimpleNamespace(alpha=0.05, budget=3, reduction_factor=3, cost="added")
    grid = bench_race.run("grid", data, (20, 50), 0, args)
    assert grid["seconds"] == sum(3.0 + n for n in range(6)) + 60.0 + 6 * 22.0 and tuple(grid["pick"]) == best
    race = bench_race.run("race", data, (20, 50), 0, args)
    assert tuple(race["pick"]) in tied and race["stopped"] >= 3  # the four far worse trials: most stop early
    reach = {0: 40, 1: 100, 2: 220}  # items a trial has paid for when it stops after each block (20, 50 a task; all)
    assert len(race["reached"]) == 6
    spent = race["seconds"] - sum(3.0 + n for n in range(6)) - 60.0
    assert spent == pytest.approx(0.1 * sum(reach[b] for b in race["reached"]))
    assert race["stopped"] == sum(b < 2 for b in race["reached"]) and spent < 6 * 22.0
    out = subprocess.run([sys.executable, str(REPO / "bench" / "bench_race.py"), str(tmp_path), "--blocks", "20,50",
                          "--seeds", "3", "--budget", "3", "--json", str(tmp_path / "race.json")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    saved = json.loads((tmp_path / "race.json").read_text())
    assert set(saved["searches"]) == set(bench_race.SEARCHES) and saved["searches"]["grid"]["in_band"] == 3
    # regret written out: the best's mean over tasks of its items' mean, less the pick's
    for search, replayed in saved["searches"].items():
        regrets = [means[best] - means[tuple(r["pick"])] for r in replayed["runs"]]
        assert replayed["regret_max"] == pytest.approx(max(regrets)), search
        assert replayed["regret_median"] == pytest.approx(float(np.median(regrets))), search
    assert saved["searches"]["grid"]["regret_max"] == 0.0 and saved["searches"]["tpe_race"]["regret_max"] > 0.2


def test_a_sub_grid_of_a_grid_still_running_is_replayed_alone(tmp_path):
    """`--only`: the trials with the named values (a complete sub-grid) are replayed; a running trial outside it, whose
    folder has no outcomes yet, and one started with nothing reported (an empty result.json), are passed over instead
    of refusing the whole folder."""
    truth = write_grid(tmp_path)
    running = tmp_path / "sweep_trainable_x_00006_6_running"
    running.mkdir()
    (running / "result.json").write_text(json.dumps({"stage": "ppl", "taylor_seq_len": 64, "taylor_num_samples": 8,
                                                     "pruning_method": "taylor"}) + "\n")
    with pytest.raises(SystemExit, match="no per-item outcomes"):
        bench_race.load_grid(tmp_path)
    started = tmp_path / "sweep_trainable_x_00007_7_started"  # started, nothing reported yet: an empty result.json
    started.mkdir()
    (started / "result.json").write_text("")
    data = bench_race.load_grid(tmp_path, {"taylor_seq_len": {"16"}})
    assert set(data["configs"]) == {key for key in KEYS if key[0] == 16}
    for key, config in data["configs"].items():
        assert list(config["scores"].sort_index().items()) == list(truth[key].sort_index().items())
    out = subprocess.run([sys.executable, str(REPO / "bench" / "bench_race.py"), str(tmp_path), "--only", "seq_len=16"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "--only 'seq_len=16': give one of taylor_seq_len" in out.stderr


def test_a_grid_scored_on_seeded_items_replays_as_the_same_grid_on_the_first_items(tmp_path):
    """A sweep's seeded items are doc ids spread over each task (the same for every trial). Kept under increasing ids
    that are not 0..n-1, the grid replays exactly as it does under 0..n-1: the blocks draw positions in each task's
    sorted ids. A trial scored on other items than the rest is refused, naming it."""
    write_grid(tmp_path / "first")
    write_grid(tmp_path / "seeded", doc_id=lambda task, i: 3 + 7 * i + (1000 if task == "piqa" else 0))
    first, seeded = bench_race.load_grid(tmp_path / "first"), bench_race.load_grid(tmp_path / "seeded")
    assert seeded["tasks"] == first["tasks"] == TASKS
    assert seeded["population"]["arc_easy"] == tuple(3 + 7 * i for i in range(100))
    args = SimpleNamespace(alpha=0.05, budget=3, reduction_factor=3, cost="added")
    for search in bench_race.SEARCHES:
        for seed in (0, 1):
            assert bench_race.run(search, seeded, (20, 50), seed, args) == \
                bench_race.run(search, first, (20, 50), seed, args), (search, seed)

    odd = tmp_path / "seeded" / "sweep_trainable_x_00002" / "outcomes_zero_shot_all.parquet"
    outcomes = pd.read_parquet(odd)
    outcomes.loc[0, "doc_id"] = 1  # one item that no other trial scored
    outcomes.to_parquet(odd)
    with pytest.raises(SystemExit, match=r"\(16, 8, 'blockwise'\) was scored on other items than"):
        bench_race.load_grid(tmp_path / "seeded")


def test_a_grid_priced_at_one_machines_rates_costs_what_those_rates_say(tmp_path, monkeypatch):
    """`--rates`: a grid whose trials ran on two machines is priced at one machine's measured seconds per item and
    per importance pass; each trial's own load and prune seconds stay. A rates file that lacks a seq_len of the
    grid is refused, naming it."""
    write_grid(tmp_path / "grid")
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"item_s": 0.5, "importance_s": {"16": 7.0, "32": 11.0}}))
    data = bench_race.with_rates(bench_race.load_grid(tmp_path / "grid"), rates)
    args = SimpleNamespace(alpha=0.05, budget=3, reduction_factor=3, cost="added")
    grid = bench_race.run("grid", data, (20, 50), 0, args)
    assert grid["seconds"] == pytest.approx(sum(3.0 + n for n in range(6)) + 7.0 + 11.0 + 6 * 220 * 0.5)
    race = bench_race.run("race", data, (20, 50), 0, args)
    reach = {0: 40, 1: 100, 2: 220}
    assert race["seconds"] == pytest.approx(sum(3.0 + n for n in range(6)) + 18.0
                                            + 0.5 * sum(reach[b] for b in race["reached"]))
    rates.write_text(json.dumps({"item_s": 0.5, "importance_s": {"16": 7.0}}))
    with pytest.raises(SystemExit, match=r"no importance_s for the passes \(seq_len, statistics\) "
                                         r"\[\(32, 'gradients'\)\]"):
        bench_race.with_rates(bench_race.load_grid(tmp_path / "grid"), rates)
    monkeypatch.setattr(sys, "argv", ["bench_race.py", str(tmp_path / "grid"), "--seeds", "1", "--rates", str(rates)])
    with pytest.raises(SystemExit, match=r"no importance_s for the passes"):  # the flag reaches the pricing
        bench_race.main()


def test_two_sweeps_of_one_grid_export_into_one_folder_with_every_cache_event(tmp_path):
    """bench/export_grid.py: a grid run in two sweeps is kept in one folder: both sweeps' finished trials, and both
    caches' events (merged, each line once however often it is exported), so the replay finds every pass."""
    sys.path.insert(0, str(REPO / "bench"))
    import export_grid

    events = {}
    for sweep, lines in (("a", ['{"event": "computed", "seq_len": "16"}', '{"event": "hit"}']),
                         ("b", ['{"event": "computed", "seq_len": "256"}'])):
        trial = tmp_path / sweep / f"sweep_trainable_{sweep}_00000"
        trial.mkdir(parents=True)
        for name in ("params.json", "evaluation.json", "result.json"):
            (trial / name).write_text("{}")
        (tmp_path / sweep / "importance_cache").mkdir()
        (tmp_path / sweep / "importance_cache" / "events.jsonl").write_text("\n".join(lines) + "\n")
        events[sweep] = lines
    target = tmp_path / "kept"
    for sweep in ("a", "b", "a", "b"):
        assert export_grid.export(tmp_path / sweep, target) == 1
    assert sorted(p.name for p in target.iterdir()) == ["importance_cache", "sweep_trainable_a_00000",
                                                         "sweep_trainable_b_00000"]
    assert (target / "importance_cache" / "events.jsonl").read_text().splitlines() == events["a"] + events["b"]


def test_a_grid_over_other_dimensions_replays_with_one_importance_pass_per_kind_of_statistics(tmp_path):
    """The Qwen space's kind of grid (method x criterion x depth_share, seq_len fixed): its dimensions are read from
    the trials' params.json, the taylor criterion's trials share one gradient pass and wanda_sp's one activation pass,
    each paid once per search, and TPE proposes over those dimensions."""
    rng = np.random.default_rng(1)
    base = {t: rng.random(n) for t, n in TASKS.items()}
    keys = [(m, c, d) for m in ("taylor", "blockwise") for c in ("taylor", "wanda_sp") for d in (0.0, 0.5)]
    for n, key in enumerate(keys):
        folder = tmp_path / f"sweep_trainable_q_{n:05d}"
        folder.mkdir()
        accuracy = 0.6 - 0.05 * n
        rows = [(t, i, float(base[t][i] < accuracy), np.nan) for t, size in TASKS.items() for i in range(size)]
        pd.DataFrame(rows, columns=["task", "doc_id", "acc", "acc_norm"]).to_parquet(
            folder / "outcomes_zero_shot_all.parquet")
        params = {"fixed": {"evaluation": EVALUATION}, "criterion": key[1], "depth_share": key[2], "model": "m",
                  "pruning_method": key[0], "seed": 0}
        (folder / "params.json").write_text(json.dumps(params))
        computed = key[0] == "taylor" and key[2] == 0.0  # the first trial of each criterion computes its pass
        result = {"pruning_method": key[0], "criterion": key[1], "depth_share": key[2], "taylor_seq_len": 64,
                  "load_s": 1.0, "prune_s": 1.0, "stage": "zero_shot_all", "zero_shot_all_s": 22.0,
                  "importance_cache": "computed" if computed else "hit",
                  "importance_s": (40.0 if key[1] == "taylor" else 5.0) if computed else 0.5,
                  **({"similarity_s": 3.0} if key[2] else {})}  # a mixed cut's own layer measure
        (folder / "result.json").write_text(json.dumps(result) + "\n")
    data = bench_race.load_grid(tmp_path)
    assert data["names"] == ("pruning_method", "criterion", "depth_share")
    assert data["importance"] == {(64, "gradients"): 40.0, (64, "activations"): 5.0}
    assert set(data["configs"]) == set(keys)
    args = SimpleNamespace(alpha=0.05, budget=4, reduction_factor=3, cost="added")
    grid = bench_race.run("grid", data, (20, 50), 0, args)
    assert grid["seconds"] == pytest.approx(8 * 2.0 + 4 * 3.0 + 40.0 + 5.0 + 8 * 22.0)
    assert tuple(grid["pick"]) == keys[0]
    tpe = bench_race.run("tpe_race", data, (20, 50), 0, args)
    assert tpe["trials"] == 4 and tuple(tpe["pick"]) in set(keys)
    only = bench_race.load_grid(tmp_path, {"criterion": {"wanda_sp"}})
    assert set(only["configs"]) == {k for k in keys if k[1] == "wanda_sp"}
    wanda_sp = bench_race.run("grid", only, (20, 50), 0, args)["seconds"]
    assert wanda_sp == pytest.approx(4 * 2.0 + 2 * 3.0 + 5.0 + 4 * 22.0)
