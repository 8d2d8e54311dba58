"""Issue 80, must-show 3: a Hypothesis property over a real sweep folder. One of its JSON or parquet files is edited
at random (a value changed, a key deleted, a row dropped or doubled, the file cut short); after the edit `status`,
`report` and `export` each either give the untouched folder's numbers or name the edited file (a refusal, a flagged
trial, a note), and none raises anything but the product's own one-line errors."""

import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taylor_tune.errors import TaylorTuneError
from tests.sweep_helpers import run_sweep_to_end, write_experiment

pytestmark = pytest.mark.slow  # a Ray sweep, then an export per example

STATE_NAMES = ("experiment state",)  # how status names the experiment state it reads


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, ray_head):
    """A finished two-trial sweep (a random tiny model, so that items differ), what status and report say of it, and
    its best trial exported once: the numbers every edited copy is held to."""
    from taylor_tune.export import export
    from taylor_tune.reporting import load_trials
    from taylor_tune.reporting.status import sweep_status

    root = tmp_path_factory.mktemp("property")
    experiment = write_experiment(
        root, "edited", models=["tiny-llama-random"],
        search_space={"taylor_seq_len": {"grid": [16]}, "taylor_num_samples": {"grid": [8]},
                      "pruning_method": {"grid": ["taylor", "blockwise"]}},
        evaluation={"tasks": "piqa", "task_data": "world", "ppl": "world", "ppl_max_windows": 4, "batch_size": 16,
                    "fidelities": [20], "speed": None})
    run_sweep_to_end(experiment, cluster=ray_head)
    folder = root / "sweeps" / "edited"
    status = sweep_status(str(folder))
    table = load_trials(str(folder))
    best = status["best"]["tiny-llama-random"]["trial_id"]
    exported = json.loads((export(str(folder), root / "export", trial=best) / "export.json").read_text())
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                   if p.suffix in (".json", ".parquet") and p.is_file())
    return {"folder": folder, "status": summary(status), "report": numbers(table), "best": best,
            "checks": exported["checks"], "files": files}


def summary(status: dict) -> dict:
    return {k: v for k, v in status.items() if k not in ("saved_s_ago", "disagree")}


def numbers(table) -> dict:
    """What the report rests on: each trial's validity and numbers, and the items and windows it pairs on."""
    rows = {r["trial_id"]: (bool(r["valid"]), *(None if not isinstance(r.get(k), float) or math.isnan(r[k])
                                                 else r[k] for k in ("acc_mean", "ppl", "params_count")))
            for _, r in table.trials.iterrows()}
    return {"rows": rows, "outcomes": {t: len(v) for t, v in table.outcomes.items()},
            "windows": {t: len(v) for t, v in table.ppl_windows.items()}}


# ------------------------------------------------------------------ the edits


def leaves(value, path=()):
    """Every place in a JSON value: each leaf, and each key of a mapping (which an edit may delete)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield (*path, key)
            yield from leaves(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from leaves(item, (*path, i))
    else:
        yield path


def changed(value, how: int):
    if isinstance(value, bool):
        return [not value, None, "yes"][how % 3]
    if isinstance(value, (int, float)):
        return [value * 2 + 1, -value - 1, 0, None, "1", value + 1e-3][how % 6]
    if isinstance(value, str):
        return [value + "x", "", None, 0][how % 4]
    if value is None:
        return [0, "x", []][how % 3]
    return [None, 0][how % 2]


def edit_json(text: str, draw) -> str:
    """One edit of a JSON file, or of a JSON-lines file (result.json, a cache entry's header and payload)."""
    lines = text.splitlines()
    try:
        documents, joined = [json.loads(text)], False
    except ValueError:
        documents, joined = [json.loads(line) for line in lines if line.strip()], True
    if draw(st.integers(0, 9)) == 0:  # cut short
        return text[: draw(st.integers(0, max(0, len(text) - 1)))]
    places = [(i, path) for i, doc in enumerate(documents) for path in leaves(doc)]
    if not places:
        return text + "x"
    i, path = draw(st.sampled_from(places))
    if not path:
        documents[i] = changed(documents[i], draw(st.integers(0, 5)))
    else:
        parent = documents[i]
        for step in path[:-1]:
            parent = parent[step]
        if isinstance(parent, dict) and draw(st.integers(0, 4)) == 0:
            del parent[path[-1]]
        else:
            parent[path[-1]] = changed(parent[path[-1]], draw(st.integers(0, 5)))
    if joined:
        return "\n".join(json.dumps(doc) for doc in documents) + "\n"
    return json.dumps(documents[0])


def edit_parquet(path: Path, draw) -> None:
    frame = pd.read_parquet(path)
    how = draw(st.integers(0, 3))
    if len(frame) == 0 or how == 0:
        frame = pd.concat([frame, frame.iloc[:1]])  # a row twice
    elif how == 1:
        frame = frame.drop(frame.index[draw(st.integers(0, len(frame) - 1))])  # a row gone
    else:
        row = draw(st.integers(0, len(frame) - 1))
        column = draw(st.sampled_from([c for c in frame.columns if pd.api.types.is_numeric_dtype(frame[c])]))
        value = frame[column].iloc[row]
        frame.iloc[row, frame.columns.get_loc(column)] = (1 - value) if how == 2 else value * 2 + 1
    frame.to_parquet(path)


# ------------------------------------------------------------------ the property


def named(message: str, edited: str) -> bool:
    name = Path(edited).name
    return name in message or (name.startswith("experiment_state-") and any(s in message for s in STATE_NAMES))


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_after_any_one_edit_status_report_and_export_give_the_same_numbers_or_name_the_file(sweep, tmp_path_factory,
                                                                                           data):
    from taylor_tune.export import export
    from taylor_tune.reporting import build_report, load_trials
    from taylor_tune.reporting.status import sweep_status

    work = tmp_path_factory.mktemp("edit")
    copy = work / "edited"
    shutil.copytree(sweep["folder"], copy)
    edited = data.draw(st.sampled_from(sweep["files"]), label="file")
    path = copy / edited
    raw = path.read_bytes()
    if path.suffix == ".parquet":
        edit_parquet(path, data.draw)
    elif raw[:1] == b"\x80":  # Ray's basic-variant-state-*.json is a pickle under a .json name: bytes cut
        path.write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1))])
    else:
        path.write_text(edit_json(raw.decode(), data.draw))

    try:
        status = sweep_status(str(copy))
    except TaylorTuneError as error:
        assert named(str(error), edited), (edited, str(error))
    else:
        assert summary(status) == sweep["status"] or any(named(line, edited) for line in status["disagree"]), (
            edited, status)

    try:
        table = load_trials(str(copy))
        build_report(str(copy))  # every section computed, nothing raised
    except TaylorTuneError as error:
        assert named(str(error), edited), (edited, str(error))
    else:
        said = [str(r) for r in table.trials["reason"].dropna()] + table.notes
        assert numbers(table) == sweep["report"] or any(named(line, edited) for line in said), (edited, said,
                                                                                                  numbers(table))

    try:
        written = export(str(copy), work / "export", trial=sweep["best"])
    except TaylorTuneError as error:
        assert named(str(error), edited), (edited, str(error))
    else:
        assert json.loads((written / "export.json").read_text())["checks"] == sweep["checks"], edited
    shutil.rmtree(work)
