"""Issue 91, case 1: the guards a resume passes hold in a bucket as on a disk. A Tune experiment taylor_tune did not
write, a searcher state cut short and a damaged experiment state, each laid in `s3://` (a real S3 server on loopback,
`tests/s3_helpers.py`): one line and exit 2 before anything is unpickled, where the pickle ran, or a traceback was
followed by exit 0 and a finished trial was lost from the state. A real sweep's finished trial survives it all.
Issue 94, must-show 2: the world-writable pickle's guard too, where a bucket lets anyone write."""

import json
import pickle
import subprocess
import sys
import time

import pytest
import yaml

from taylor_tune.cli import main
from tests.s3_helpers import BUCKET, seaweedfs
from tests.sweep_helpers import REPO, SMALL, env, kill_ray_started_after

pytestmark = pytest.mark.slow  # a real S3 server


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture
def aws(s3, monkeypatch):
    for key, value in s3["env"].items():  # this process reads the bucket: the server on loopback, never AWS
        monkeypatch.setenv(key, value)
    return s3


def bucket(server):
    from pyarrow import fs

    return fs.S3FileSystem(access_key=server["env"]["AWS_ACCESS_KEY_ID"], endpoint_override=server["endpoint"],
                           secret_key=server["env"]["AWS_SECRET_ACCESS_KEY"], scheme="http", region="us-east-1")


def lay(server, prefix: str, files: dict[str, bytes]) -> None:
    filesystem = bucket(server)
    for name, data in files.items():
        with filesystem.open_output_stream(f"{BUCKET}/{prefix}/{name}") as stream:
            stream.write(data)


def listing(server, prefix: str) -> dict[str, bytes]:
    from pyarrow import fs

    filesystem = bucket(server)
    found = filesystem.get_file_info(fs.FileSelector(f"{BUCKET}/{prefix}", recursive=True, allow_not_found=True))
    return {i.path: filesystem.open_input_stream(i.path).read() for i in found if i.type == fs.FileType.File}


class Planted:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def sweep_in_process(capsys, tmp_path, storage: str):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({"name": "exp", **SMALL, "storage_path": storage}))
    code = main(["sweep", str(path)])
    captured = capsys.readouterr()
    return code, captured.err


def one_line(code, err, expected):
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("taylor-tune: error: ") and "Traceback" not in err, err
    assert expected in err, err


STATE = json.dumps({"trial_data": [[json.dumps({"trial_id": "t_00000", "status": "TERMINATED",
                                                "config": {"model": "tiny-llama"}}), json.dumps({"last_result": {}})]]})


def test_a_tune_experiment_taylor_tune_did_not_write_is_refused_in_a_bucket_before_its_pickle_is_read(
        aws, capsys, tmp_path):
    marker = tmp_path / "unpickled"
    lay(aws, "plain/exp", {"tuner.pkl": pickle.dumps(Planted(marker)),
                           "experiment_state-2026-01-01_00-00-00.json": STATE.encode()})
    before = listing(aws, "plain")
    code, err = sweep_in_process(capsys, tmp_path, f"s3://{BUCKET}/plain")
    one_line(code, err, f"s3://{BUCKET}/plain/exp holds a Ray Tune experiment (experiment_state-2026-01-01_00-00-00"
             ".json, tuner.pkl) that taylor_tune did not write")
    assert not marker.exists() and listing(aws, "plain") == before  # nothing unpickled, nothing written


@pytest.mark.parametrize("damaged", ["cut", "empty", "not a pickle"])
def test_a_searcher_state_cut_short_in_a_bucket_is_named_in_one_line(aws, capsys, tmp_path, damaged):
    whole = pickle.dumps({"studies": {"tiny-llama": list(range(50))}, "proposed": {"tiny-llama": 3}})
    data = {"cut": whole[:-7], "empty": b"", "not a pickle": b"not a pickle at all"}[damaged]
    prefix = f"cut-{damaged.replace(' ', '-')}"
    lay(aws, f"{prefix}/exp", {"tuner.pkl": pickle.dumps({"tuner": "state"}), "taylor_tune_experiment.json": b"{}",
                               "experiment_state-2026-01-01_00-00-00.json": STATE.encode(),
                               "searcher-state-2026-01-01_00-00-00.pkl": data})
    before = listing(aws, prefix)
    code, err = sweep_in_process(capsys, tmp_path, f"s3://{BUCKET}/{prefix}")
    one_line(code, err, f"s3://{BUCKET}/{prefix}/exp/searcher-state-2026-01-01_00-00-00.pkl is damaged (")
    assert "a resume would restart the search from nothing over the finished trials" in err
    assert listing(aws, prefix) == before


def test_a_damaged_state_in_a_bucket_is_refused_over_an_intact_one_and_set_aside_where_none_is(aws, capsys, tmp_path):
    from taylor_tune.storage.folder import has_state, set_aside_damaged_state

    lay(aws, "states/exp", {"tuner.pkl": b"\x80\x05N.", "taylor_tune_experiment.json": b"{}",
                            "experiment_state-2026-01-01_00-00-00.json": STATE.encode(),
                            "experiment_state-2026-01-02_00-00-00.json": STATE[: len(STATE) // 2].encode()})
    code, err = sweep_in_process(capsys, tmp_path, f"s3://{BUCKET}/states")
    one_line(code, err, f"s3://{BUCKET}/states/exp/experiment_state-2026-01-02_00-00-00.json: the experiment state is "
             "damaged")
    assert "the previous state experiment_state-2026-01-01_00-00-00.json is intact" in err

    folder = f"s3://{BUCKET}/cutshort/exp"  # none intact: set aside, so that the sweep starts afresh
    lay(aws, "cutshort/exp", {"experiment_state-2026-01-02_00-00-00.json": STATE[:10].encode()})
    assert not has_state(folder)
    assert set_aside_damaged_state(folder) == ["experiment_state-2026-01-02_00-00-00.json.damaged"]
    assert list(listing(aws, "cutshort")) == [f"{BUCKET}/cutshort/exp/experiment_state-2026-01-02_00-00-00.json"
                                              ".damaged"]
    lay(aws, "whole/exp", {"experiment_state-2026-01-02_00-00-00.json": STATE.encode()})
    assert has_state(f"s3://{BUCKET}/whole/exp") and set_aside_damaged_state(f"s3://{BUCKET}/whole/exp") == []


def test_a_bucket_anyone_may_write_is_refused_before_its_state_is_unpickled(tmp_path_factory, tmp_path, capsys,
                                                                           monkeypatch):
    """On a disk a pickle every user can write is refused (tests/test_user_errors.py); a bucket has no owner per
    object, and its counterpart is a bucket whose policy lets a client without credentials write. A taylor_tune
    sweep's folder laid there, its tuner.pkl a planted pickle: the sweep is refused in one line, exit 2, before the
    pickle runs, the probe it wrote anonymously removed; TAYLOR_TUNE_TRUST_EXPERIMENT=1 opts in. The same folder in a
    bucket closed to anonymous writes passes the guard (the other tests of this module resume through it)."""
    from taylor_tune.errors import StorageError
    from taylor_tune.storage.folder import check_resume_trust

    marker = tmp_path / "unpickled"
    with seaweedfs(tmp_path_factory.mktemp("open-seaweedfs"), anyone_writes=True) as server:
        for key, value in server["env"].items():
            monkeypatch.setenv(key, value)
        lay(server, "open/exp", {"tuner.pkl": pickle.dumps(Planted(marker)), "taylor_tune_experiment.json": b"{}",
                                 "experiment_state-2026-01-01_00-00-00.json": STATE.encode()})
        before = listing(server, "open")
        code, err = sweep_in_process(capsys, tmp_path, f"s3://{BUCKET}/open")
        one_line(code, err, f"s3://{BUCKET}/open/exp can be written by anyone (a client without credentials wrote a "
                 "probe there), and resuming the sweep would unpickle its state")
        assert not marker.exists() and listing(server, "open") == before  # nothing unpickled, the probe removed
        with pytest.raises(StorageError, match="can be written by anyone"):
            check_resume_trust(f"s3://{BUCKET}/open/exp")
        monkeypatch.setenv("TAYLOR_TUNE_TRUST_EXPERIMENT", "1")
        check_resume_trust(f"s3://{BUCKET}/open/exp")
        monkeypatch.delenv("TAYLOR_TUNE_TRUST_EXPERIMENT")
        assert listing(server, "open") == before


def test_a_closed_bucket_passes_the_trust_guard_with_its_state_in_place(aws):
    from taylor_tune.storage.folder import check_resume_trust

    lay(aws, "closed/exp", {"tuner.pkl": b"\x80\x05N.", "taylor_tune_experiment.json": b"{}"})
    before = listing(aws, "closed")
    check_resume_trust(f"s3://{BUCKET}/closed/exp")  # the writer's own bucket, no anonymous writes: no refusal
    assert listing(aws, "closed") == before  # and the anonymous probe, refused, left nothing


def test_a_real_sweeps_finished_trial_survives_its_state_cut_short_in_the_bucket(aws, tmp_path):
    """A one-trial sweep on s3, then each pickle its resume would read cut short in turn: the next sweep is refused
    in one line naming it, the bucket is unchanged, and status still counts the finished trial; restored, the
    resume finds it finished and runs nothing again."""
    storage = f"s3://{BUCKET}/real"
    one = {**SMALL, "search_space": {"taylor_seq_len": {"grid": [16]}, "taylor_num_samples": {"grid": [8]},
                                     "pruning_method": {"grid": ["taylor"]}}, "models": ["tiny-llama-random"]}
    experiment = tmp_path / "exp.yaml"
    experiment.write_text(yaml.safe_dump({"name": "exp", **one, "storage_path": storage}))
    run = {**env(), **aws["env"]}

    def taylor_tune(*args):
        started = time.time()
        proc = subprocess.run([sys.executable, "-m", "taylor_tune", *args], capture_output=True, text=True,
                              timeout=600, cwd=REPO, env=run)
        kill_ray_started_after(started)
        return proc

    proc = taylor_tune("sweep", str(experiment))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    finished = listing(aws, "real")
    pickles = sorted(k for k, v in finished.items() if k.count("/") == 3 and v[:1] == b"\x80")
    assert any(k.endswith("tuner.pkl") for k in pickles) and len(pickles) >= 2, pickles
    filesystem = bucket(aws)
    for key in pickles:
        with filesystem.open_output_stream(key) as stream:
            stream.write(finished[key][:-5])
        proc = taylor_tune("sweep", str(experiment))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
        assert f"s3://{key} is damaged (" in proc.stderr, proc.stderr
        assert listing(aws, "real") == {**finished, key: finished[key][:-5]}
        status = taylor_tune("status", f"{storage}/exp")
        assert status.returncode == 0 and "finished 1" in status.stdout, status.stdout + status.stderr
        with filesystem.open_output_stream(key) as stream:
            stream.write(finished[key])
    proc = taylor_tune("sweep", str(experiment))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    trials = {k.split("/")[3] for k in listing(aws, "real") if k.count("/") > 3 and "/sweep_trainable_" in k}
    assert len(trials) == 1, trials  # resumed, nothing ran again


@pytest.mark.parametrize("command", ["report", "export"])
@pytest.mark.parametrize("case", ["wrong credentials", "endpoint down"])
def test_report_and_export_of_a_bucket_they_cannot_read_are_one_line(s3, tmp_path, command, case):
    """Issue 91, case 6: `report` and `export` of an `s3://` sweep with credentials the server refuses, or with its
    endpoint down, ended in about 30 lines of traceback, exit 1 (`read_experiment` let the OSError through), where
    `status` and `sweep` said one line. Now one line naming the sweep and what failed, exit 2."""
    from tests.s3_helpers import aws_env
    from tests.sweep_helpers import free_port

    lay(s3, "unreadable/exp", {"taylor_tune_experiment.json": b"{}"})
    aws = s3["env"] | {"AWS_SECRET_ACCESS_KEY": "not-the-secret"} if case == "wrong credentials" \
        else aws_env(f"http://127.0.0.1:{free_port()}")
    folder = f"s3://{BUCKET}/unreadable/exp"
    proc = subprocess.run([sys.executable, "-m", "taylor_tune", command, folder, "--output", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env={**env(), **aws})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    meaning = "its credentials are refused" if case == "wrong credentials" else "its endpoint cannot be reached"
    assert proc.stderr.startswith("taylor-tune: error: ") and f"{folder}: {meaning} (" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
