"""Reading one Tune trial folder into a row, against folders written by hand whose every value the test knows:
the last report, the configuration a trial that never reported still names, why a trial could not be read, the last
failure of its error.txt, and the item limit of its final evaluation; then judging rows (each reason by hand) and
keeping one row per trial after a resume."""

import json

import pandas as pd
import pytest
from pyarrow import fs

from taylor_tune.errors import ReportError
from taylor_tune.reporting.frame import (
    SPEC_COLUMNS,
    _final_fidelity,
    _last_failure,
    consolidate,
    load_trials,
    read_experiment,
    read_trial,
)
from taylor_tune.schema import CONFIG_COLUMNS

NAME = "sweep_trainable_abcde_00003_3_model=tiny_2026-11-21_00-00-00"
CONFIG = {"model": "tiny-llama", "pruning_method": "blockwise", "taylor_seq_len": 64, "taylor_num_samples": 8,
          "seed": 0, "fixed": {"evaluation": {"fidelities": [30, 200]}}}


PARAMS = json.dumps(CONFIG)


def trial(tmp_path, result=None, params=PARAMS, error=None):
    """A trial folder with the files given (None: the file is absent); its path as read_trial is given it."""
    folder = tmp_path / NAME
    folder.mkdir(parents=True)
    for name, text in (("result.json", result), ("params.json", params), ("error.txt", error)):
        if text is not None:
            (folder / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(folder)


def report(**values) -> str:
    return json.dumps(values) + "\n"


def test_a_trial_is_its_last_report_its_folder_and_its_configuration(tmp_path):
    first = report(stage="pruned", ppl=30.0, trial_id="abcde_00003", output_dir="/run/a")
    last = report(stage="zero_shot", ppl=31.0, acc_mean=0.5, model="tiny-llama", pruning_method="taylor",
                  trial_id="abcde_00003", output_dir="/node/run/a", config=CONFIG)
    path = trial(tmp_path, first + last)
    row = read_trial(fs.LocalFileSystem(), path + "/")  # a trailing slash, as a URI listing may give it
    assert row == {
        "trial_id": "abcde_00003", "trial_dir": path + "/", "stage": "zero_shot", "ppl": 31.0, "acc_mean": 0.5,
        "model": "tiny-llama", "pruning_method": "taylor",  # the report's own value, not the params'
        "taylor_seq_len": 64, "taylor_num_samples": 8, "seed": 0,  # the rest from the configuration
        "run_dir": "/node/run/a",  # where the trial wrote during the run
        "output_dir": path + "/",  # where its artifacts are read now
        "final_fidelity": 200,
    }


@pytest.mark.parametrize("result, reason", [
    (None, "result.json is missing"),
    ("", "no results reported (result.json is empty)"),
    ('{"ppl": 3', "result.json has no readable report"),  # a driver killed mid-write
    ('{"ppl": 3\n{"acc_mean": \n', "result.json has no readable report"),
])
def test_a_trial_without_a_readable_report_still_names_its_configuration(tmp_path, result, reason):
    row = read_trial(fs.LocalFileSystem(), trial(tmp_path, result) + "/")  # the id from the folder's name alone
    assert row["read_error"] == reason and "run_dir" not in row
    assert {k: row[k] for k in ("model", "pruning_method", "taylor_seq_len", "taylor_num_samples", "seed")} == {
        k: CONFIG[k] for k in ("model", "pruning_method", "taylor_seq_len", "taylor_num_samples", "seed")}
    assert row["final_fidelity"] == 200 and row["trial_id"] == "abcde_00003"


def test_a_truncated_last_line_leaves_the_report_before_it(tmp_path):
    row = read_trial(fs.LocalFileSystem(), trial(tmp_path, report(ppl=30.0, stage="pruned") + '{"ppl": 3'))
    assert row["ppl"] == 30.0 and row["stage"] == "pruned" and "read_error" not in row


@pytest.mark.parametrize("params", [None, "", "{not json"])
def test_without_readable_params_the_configuration_comes_from_the_last_report(tmp_path, params):
    config = CONFIG | {"seed": 7, "fixed": {"evaluation": {"fidelities": [30, 0]}}}
    row = read_trial(fs.LocalFileSystem(), trial(tmp_path, report(ppl=30.0, config=config), params=params))
    assert row["seed"] == 7 and row["model"] == "tiny-llama" and row["final_fidelity"] == 0
    assert "config" not in row
    bare = read_trial(fs.LocalFileSystem(), trial(tmp_path / "bare", None, params=params))
    assert bare["read_error"] == "result.json is missing" and bare["final_fidelity"] is None and "seed" not in bare


def test_undecodable_bytes_are_replaced_not_fatal(tmp_path):
    result = b'{"ppl": 30.0, "note": "caf\xe9"}\n'  # Latin-1, not UTF-8
    row = read_trial(fs.LocalFileSystem(), trial(tmp_path, result))
    assert row["ppl"] == 30.0 and row["note"] == "caf\ufffd"


@pytest.mark.parametrize("objectives, expected", [
    ([], None),
    ([{"metric": "ppl", "mode": "min"}], None),  # one objective: no multi-objective column
    ([{"metric": "ppl", "mode": "min"}, {"metric": "decode_speedup", "mode": "max"}], "ppl:min,decode_speedup:max"),
    ([{"metric": "acc_mean", "mode": "max"}, {"metric": "ppl", "mode": "min"},
      {"metric": "memory_ratio", "mode": "min"}], "acc_mean:max,ppl:min,memory_ratio:min"),
])
def test_the_searched_objectives_are_recorded_primary_first(tmp_path, objectives, expected):
    config = CONFIG | {"fixed": {"objective": {"metric": "ppl", "mode": "min"}, "objectives": objectives}}
    row = read_trial(fs.LocalFileSystem(), trial(tmp_path, report(ppl=30.0), params=json.dumps(config)))
    assert (row["objective_metric"], row["objective_mode"]) == ("ppl", "min")
    assert row.get("objectives") == expected


FAILURE = ("Failure # {n} (occurred at 2026-11-21_00-0{n}-00)\nTraceback (most recent call last):\n"
           '  File "x.py"\n{line}\n')


@pytest.mark.parametrize("text, expected", [
    (FAILURE.format(n=1, line="ValueError: first") + "\n" + FAILURE.format(n=2, line="RuntimeError: second\n\n"),
     "RuntimeError: second"),
    ("Traceback (most recent call last):\n  File \"x.py\"\nKeyError: 'ppl'\n", "KeyError: 'ppl'"),  # no marker
    (FAILURE.format(n=1, line="ValueError: first") + "Failure # ", "unknown error"),  # cut after the last marker
    ("\n \n", "unknown error"),
])
def test_the_error_is_the_last_line_of_the_last_failure(text, expected, tmp_path):
    assert _last_failure(text) == expected
    row = read_trial(fs.LocalFileSystem(), trial(tmp_path, report(ppl=1.0), error=text))
    assert row["error"] == expected


@pytest.mark.parametrize("config, expected", [
    ({"fixed": {"evaluation": {"fidelities": [30, 200]}}}, 200),
    ({"fixed": {"evaluation": {"fidelities": [30, 0]}}}, 0),  # 0: every item
    ({"fixed": {"evaluation": {"fidelities": [None]}}}, 0),
    ({"fixed": {"evaluation": {"fidelities": []}}}, None),
    ({"fixed": {"evaluation": {}}}, None),
    ({"fixed": {"evaluation": None}}, None),
    ({"fixed": {}}, None),
    ({"fixed": None}, None),
    ({}, None),
    (None, None),
])
def test_the_final_fidelity_is_the_last_evaluations_item_limit(config, expected):
    assert _final_fidelity(config) == expected


# Judging rows: each reason written out by hand for the row that earns it.

BASE = {"model": "m", "trial_id": "t0", "acc_mean": 0.5, "ppl": 20.0, "acc_boolq": 0.6, "acc_piqa": 0.4}
INF = float("inf")


@pytest.mark.parametrize("change, reason", [
    ({}, None),
    ({"read_error": "result.json is missing"}, "result.json is missing"),
    ({"read_error": "no results reported", "error": "OSError: disk"}, "errored: OSError: disk"),
    ({"acc_mean": None, "error": "ValueError: bad"}, "errored: ValueError: bad"),
    ({"acc_mean": None, "stage": "recovery_25"},
     "incomplete: stopped during recovery, before the evaluation (last stage 'recovery_25')"),
    ({"acc_mean": None, "stage": "prune"}, "incomplete: no finite acc_mean (last stage 'prune')"),
    ({"acc_mean": None}, "no finite acc_mean"),
    ({"acc_mean": INF}, "no finite acc_mean"),
    ({"objective_metric": "ppl", "ppl": None}, "no ppl, the sweep's metric"),
    ({"objective_metric": "ppl", "ppl": None, "error": "E: x"}, "errored: E: x"),
    ({"objective_metric": "ppl", "ppl": INF}, None),  # the worst perplexity is a result
    ({"objective_metric": "ppl", "ppl": "Infinity"}, None),
    ({"objective_metric": "ppl", "ppl": "inf"}, None),
    ({"objective_metric": "acc_mean", "ppl": None}, None),  # the sweep did not search perplexity
    ({"final_fidelity": 200, "fidelity": 30},
     "incomplete: evaluated on 30 items per task, not the full 200 (stopped early by the scheduler)"),
    ({"final_fidelity": 0, "fidelity": 30},
     "incomplete: evaluated on 30 items per task, not the full set (stopped early by the scheduler)"),
    ({"final_fidelity": 200, "fidelity": 30, "error": "E: y"},
     "incomplete: evaluated on 30 items per task, not the full 200 (errored: E: y)"),
    ({"final_fidelity": 200, "fidelity": 200}, None),
    ({"final_fidelity": None, "fidelity": 30}, None),  # a config that does not say: no judgement
    ({"final_fidelity": 200}, None),
    ({"acc_piqa": None}, "acc_piqa is missing or not finite"),
])
def test_each_row_gets_the_reason_it_earns(change, reason):
    """A second, complete trial of the same model beside it sets which tasks every trial must have."""
    row = {**BASE, "trial_id": "t1", **change}
    table = consolidate(pd.DataFrame([BASE, row]))
    judged = table.trials.set_index("trial_id")
    assert judged.loc["t0", "reason"] is None and bool(judged.loc["t0", "valid"])
    assert judged.loc["t1", "reason"] == reason and bool(judged.loc["t1", "valid"]) == (reason is None)


def test_a_trial_that_ran_again_after_a_resume_is_counted_once(tmp_path):
    """Same trial id in two folders: a valid one is kept over an invalid one; of two invalid ones, the later folder
    (the greater name); the rest keep their order, on a fresh index, and the dropped folders are counted."""
    rows = pd.DataFrame([  # the valid "a" in the earlier folder; the later "b" folder listed last
        {**BASE, "trial_id": "a", "output_dir": "/exp/x_a_2026-11-21_00-00-09", "acc_mean": None},
        {**BASE, "trial_id": "b", "output_dir": "/exp/x_b_2026-11-21_00-00-01", "acc_mean": None, "stage": "load"},
        {**BASE, "trial_id": "c", "output_dir": "/exp/x_c"},
        {**BASE, "trial_id": "a", "output_dir": "/exp/x_a_2026-11-21_00-00-01"},
        {**BASE, "trial_id": "b", "output_dir": "/exp/x_b_2026-11-21_00-00-02", "acc_mean": None, "stage": "ppl"},
    ])
    table = consolidate(rows)
    assert table.superseded == 2 and list(table.trials.index) == [0, 1, 2] and "index" not in table.trials
    kept = table.trials.set_index("trial_id")
    assert list(kept.index) == ["c", "a", "b"]  # the order of the rows kept
    assert kept.loc["a", "output_dir"] == "/exp/x_a_2026-11-21_00-00-01" and bool(kept.loc["a", "valid"])
    assert kept.loc["b", "output_dir"] == "/exp/x_b_2026-11-21_00-00-02" and kept.loc["b", "stage"] == "ppl"
    assert consolidate(rows.iloc[[0, 1, 2]]).superseded == 0


def test_rows_without_trial_ids_are_numbered_not_merged():
    rows = pd.DataFrame([{k: v for k, v in BASE.items() if k != "trial_id"}] * 2)
    table = consolidate(rows)
    assert list(table.trials["trial_id"]) == ["row0", "row1"] and table.superseded == 0


def test_a_folder_read_by_path_is_named_by_it(tmp_path):
    root = tmp_path / "exp"
    trial(root, report(**{k: v for k, v in BASE.items() if k != "trial_id"}, output_dir="/run"))
    table = load_trials(root)
    assert table.source == str(root) and load_trials(str(root)).source == str(root)
    assert list(table.trials["trial_id"]) == ["abcde_00003"] and bool(table.trials["valid"].iloc[0])


def test_values_arrive_as_numbers_and_every_expected_column_exists():
    """Reports written by other tools may carry numbers as strings and "None" for a missing stderr."""
    row = {"model": "m", "trial_id": "t", "acc_mean": "0.5", "ppl": "None", "acc_boolq": "0.6",
           "acc_boolq_stderr": "None", "acc_piqa": 0.4, "acc_piqa_stderr": "0.02", "extreme_pruning_layers": "2",
           "params_count": "1000", "pruning_ratio": "0.2", "grad_mean_ratio": "1.5", "decode_speedup": "1.25"}
    table = consolidate(pd.DataFrame([row], index=[7]))
    got = table.trials.iloc[0]
    expected = {"acc_mean": 0.5, "acc_boolq": 0.6, "acc_piqa": 0.4, "acc_piqa_stderr": 0.02,
                "extreme_pruning_layers": 2, "params_count": 1000, "pruning_ratio": 0.2, "grad_mean_ratio": 1.5,
                "decode_speedup": 1.25}
    assert {k: got[k] for k in expected} == expected
    assert pd.isna(got["ppl"]) and pd.isna(got["acc_boolq_stderr"])
    assert all(pd.api.types.is_numeric_dtype(table.trials[k]) for k in [*expected, "ppl", "acc_boolq_stderr"])
    assert list(table.trials.index) == [0] and "index" not in table.trials and bool(got["valid"])
    missing = [c for c in (*SPEC_COLUMNS, *CONFIG_COLUMNS) if c not in row]
    assert all(c in table.trials and pd.isna(got[c]) for c in missing)


def test_a_trial_without_a_model_is_not_valid_and_keeps_a_reason_of_its_own():
    rows = pd.DataFrame([{**BASE, "model": None, "trial_id": "complete"},
                         {**BASE, "model": None, "trial_id": "unfinished", "acc_mean": None}, BASE])
    judged = consolidate(rows).trials.set_index("trial_id")
    assert judged.loc["complete", "reason"] == "no model recorded"
    assert judged.loc["unfinished", "reason"] == "no finite acc_mean"
    assert list(judged["valid"]) == [False, False, True]


def test_a_table_names_its_source_in_its_errors():
    rows = pd.DataFrame([{**BASE, "objective_metric": "ppl", "objective_mode": "min"},
                         {**BASE, "trial_id": "t1", "objective_metric": "acc_mean", "objective_mode": "max"}])
    with pytest.raises(ReportError, match=r"^DataFrame: the trials optimized different metrics"):
        consolidate(rows).objective
    with pytest.raises(ReportError, match=r"^sweep-7: the trials optimized"):
        consolidate(rows, "sweep-7").objective


def experiment(tmp_path):
    root = tmp_path / "exp"
    folder = trial(root, report(ppl=1.0, acc_mean=0.5))
    nested = root / NAME / "checkpoint_000000"  # a folder inside a trial with a params.json of its own
    nested.mkdir()
    (nested / "params.json").write_text(PARAMS)
    (root / "driver_logs").mkdir()  # a folder of the experiment's that is no trial (no params.json)
    return root, folder


def test_only_the_experiments_own_folders_are_trials_and_a_uri_keeps_its_scheme(tmp_path):
    root, folder = experiment(tmp_path)
    local = read_experiment(str(root))
    assert list(local["output_dir"]) == [folder]  # not the nested checkpoint folder
    uri = read_experiment(f"file://{root}")
    assert list(uri["output_dir"]) == [f"file://{folder}"] and list(uri["trial_dir"]) == [folder]
    given = read_experiment(str(root), fs.LocalFileSystem())  # a filesystem given: its own paths
    assert list(given["output_dir"]) == [str(root / NAME)]
    inside = read_experiment("exp", fs.SubTreeFileSystem(str(tmp_path), fs.LocalFileSystem()))
    assert list(inside["output_dir"]) == [f"exp/{NAME}"]  # a path inside the filesystem given, not on this disk


def test_a_folder_that_is_not_an_experiment_is_refused_and_an_empty_experiment_is_empty(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="not a Tune experiment folder"):
        read_experiment(str(tmp_path / "empty"))
    (tmp_path / "started").mkdir()  # a sweep that started: Tune's state, no trial yet
    (tmp_path / "started" / "experiment_state-2026-11-21_00-00-00.json").write_text('{"trial_data": []}')
    assert read_experiment(str(tmp_path / "started")).empty
    (tmp_path / "started" / "experiment_state-2026-11-21_00-00-00.json").write_text("{}")  # not Tune's state
    with pytest.raises(ReportError, match="is not a Tune experiment state"):
        read_experiment(str(tmp_path / "started"))


def test_items_are_read_from_the_folder_given_not_from_where_the_trial_ran(tmp_path):
    """Issue 80: `report` read each trial's items from the path recorded at run time: on a copy of a sweep, edits to
    the copy changed nothing, and with the original gone the paired verdicts fell back to the independent bound
    without a word. Now the items come from the folder the report is given."""
    import shutil

    from taylor_tune.storage.names import outcomes_file

    original = tmp_path / "original" / "exp"
    for index, right in enumerate((8, 5)):
        name = f"sweep_trainable_abcde_0000{index}_{index}_x"
        folder = original / name
        folder.mkdir(parents=True)
        (folder / "params.json").write_text(json.dumps(CONFIG | {"fixed": {"evaluation": {"fidelities": [None]}}}))
        (folder / "result.json").write_text(report(
            stage="zero_shot_all", acc_mean=right / 10, acc_piqa=right / 10, model="tiny-llama", fidelity=0,
            trial_id=f"abcde_0000{index}", output_dir=f"/node/gone/{name}"))  # where it ran: not here
        outcomes = [1.0] * right + [0.0] * (10 - right)
        pd.DataFrame({"task": ["piqa"] * 10, "doc_id": range(10), "acc": outcomes, "acc_norm": outcomes}).to_parquet(
            folder / outcomes_file("zero_shot_all"))
    table = load_trials(str(original))
    assert len(table.valid) == 2 and set(table.outcomes) == {"abcde_00000", "abcde_00001"}
    assert table.outcomes["abcde_00001"].sum() == 5

    copy = tmp_path / "copy" / "exp"
    shutil.copytree(original, copy)
    shutil.rmtree(original)
    edited = next(copy.glob("sweep_trainable_abcde_00001_*")) / outcomes_file("zero_shot_all")
    frame = pd.read_parquet(edited)
    frame.loc[0, ["acc", "acc_norm"]] = 0.0  # no longer gives the reported 0.5: not paired on
    frame.to_parquet(edited)
    table = load_trials(str(copy))
    assert set(table.outcomes) == {"abcde_00000"}


def test_a_trial_whose_own_files_contradict_each_other_is_flagged_naming_them(tmp_path):
    """Issue 80: a number edited in one file of a trial was used as if true. Its last report against its final
    metrics (evaluation.json), what Tune ran (params.json) against its record (config.json), its objective against
    the sweep's record: each disagreement leaves the trial out, named."""
    final = {"stage": "zero_shot", "acc_mean": 0.5, "ppl": 31.0, "model": "tiny-llama", "pruning_method": "blockwise",
             "ppl_curve": [[4, 31.0]], "ratio": float("inf")}
    params = CONFIG | {"fixed": {"evaluation": {"fidelities": [30, 200]}, "prune": {"sparsity": 0.2},
                                 "objective": {"metric": "acc_mean", "mode": "max"}}}
    record = {"prune": {"model": "tiny-llama", "method": "blockwise", "seq_len": 64, "num_samples": 8, "seed": 0,
                        "sparsity": 0.2}, "evaluation": {"fidelities": [30, 200]}}
    experiment = tmp_path / "exp"
    folder = experiment / NAME
    folder.mkdir(parents=True)
    (folder / "params.json").write_text(json.dumps(params))
    (folder / "result.json").write_text(report(**final, fidelity=200, acc_tiny=0.5))
    (folder / "evaluation.json").write_text(json.dumps(final | {"ratio": "inf"}))  # json_safe's spelling of inf
    (folder / "config.json").write_text(json.dumps(record))
    (experiment / "taylor_tune_experiment.json").write_text(json.dumps({"metric": "acc_mean", "mode": "max"}))

    def reason() -> str | None:
        table = consolidate(read_experiment(str(experiment)))
        return table.trials.loc[0, "reason"]

    assert reason() is None
    for name, change, said in (
            ("evaluation.json", lambda d: d | {"acc_mean": 0.75},
             "result.json and evaluation.json disagree on acc_mean"),
            ("config.json", lambda d: {**d, "prune": d["prune"] | {"seq_len": 32}},
             "params.json and config.json disagree on prune.seq_len"),
            ("config.json", lambda d: {**d, "evaluation": {"fidelities": [200]}},
             "params.json and config.json disagree on evaluation.fidelities"),
            ("params.json", lambda d: {**d, "fixed": {**d["fixed"], "objective": {"metric": "ppl", "mode": "min"}}},
             "params.json and taylor_tune_experiment.json disagree on the objective (ppl min, acc_mean max)"),
            ("evaluation.json", lambda d: "{", "evaluation.json is not JSON (cut short or damaged)")):
        kept = (folder / name).read_text()
        edited = change(json.loads(kept))
        (folder / name).write_text(edited if isinstance(edited, str) else json.dumps(edited))
        assert reason() == f"its files disagree: {said}"
        (folder / name).write_text(kept)
    assert reason() is None
