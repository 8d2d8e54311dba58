"""A storage that is full, or fills up during a sweep (issue 37, finding 4): one line naming the storage and what is
free, a non-zero exit, and a rerun that finishes the sweep reusing the trials that finished before the disk filled.
On 1faffce: exit 1 with a dozen tracebacks, the newest experiment state half written, and a rerun refused (exit 2)
pointing at a previous state that did not exist. On dc4d04a (issue 62, finding 8) the exit and the last line were
right, but Ray's own tracebacks came before it (79 lines here, 2 tracebacks, and "errored: no error text"; over a
thousand lines in a longer sweep, which went on starting pending trials on the full disk).

The storage is a small tmpfs mounted for the test (root only; skipped where mounting is not allowed)."""

import re
import subprocess
import time

import pytest
from pyarrow import fs

from taylor_tune.compat.tune_state import saved_trials
from tests.sweep_helpers import kill_ray_started_after, run_sweep, write_experiment

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=80m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk, leave_mb: int):
    """Fill the disk up to `leave_mb` MB free."""
    import shutil

    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as handle:
        handle.truncate(0)
        for _ in range(max(0, (free - leave_mb * 2**20) // 2**20)):
            handle.write(b"\0" * 2**20)


def beyond(stderr: str, normal: str) -> list[str]:
    """The lines of `stderr` that a normal run's `normal` does not print (time stamps aside)."""
    stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s*")
    seen = {stamp.sub("", line) for line in normal.splitlines()}
    return [line for line in stderr.strip().splitlines() if stamp.sub("", line) not in seen]


def last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


def test_a_storage_without_room_is_refused_before_ray_in_one_line(small_disk, tmp_path):
    fill(small_disk, leave_mb=20)
    experiment = write_experiment(tmp_path, "full", storage_path=str(small_disk / "sweeps"))
    proc = run_sweep(experiment)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"storage_path: {small_disk / 'sweeps'} has 20." in proc.stderr and "needs at least 64.0 MB" in proc.stderr
    assert not (small_disk / "sweeps" / "full").exists()  # nothing started, nothing recorded under the name


def test_a_storage_that_fills_up_mid_sweep_says_so_and_the_rerun_finishes_reusing_finished_trials(small_disk,
                                                                                                   tmp_path):
    storage = small_disk / "sweeps"
    space = {"taylor_seq_len": {"grid": [16, 32]}, "taylor_num_samples": {"grid": [8]},
             "pruning_method": {"grid": ["taylor"]}}
    experiment = write_experiment(tmp_path, "fills", storage_path=str(storage), search_space=space,
                                  search={"algorithm": "grid", "max_concurrent": 1}, max_failures=0)
    started = time.time()
    proc = run_sweep(experiment, TAYLOR_TUNE_TEST_FILL=str(small_disk / "filler"))
    kill_ray_started_after(started)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = last_line(proc.stderr)
    assert line.startswith(f"taylor-tune: error: storage_path: {storage} has 0.0 MB free"), line
    assert "free space there and run the same command again" in line
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    # no trial said errored, and a status line (printed when the sweep outlasts its interval) counts none
    assert not re.search(r": errored:|\b[1-9]\d* errored\b", proc.stdout), proc.stdout[-3000:]

    (small_disk / "filler").unlink()
    started = time.time()
    again = run_sweep(experiment)
    kill_ray_started_after(started)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "2 finished, 0 errored, 0 not done, of 2" in again.stdout
    # one line: beyond what a sweep prints when nothing fills up (Ray's start-up notices), only the error line
    assert beyond(proc.stderr, again.stderr) == [line], proc.stderr[-3000:]
    trials, _ = saved_trials(fs.LocalFileSystem(), str(storage / "fills"))  # the state the rerun saved, whole
    reused = [t["config"]["taylor_seq_len"] for t in trials if t["last_result"].get("reused_artifacts")]
    assert reused == [16], "the trial that finished before the disk filled was computed again"
