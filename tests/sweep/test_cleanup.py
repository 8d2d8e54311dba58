"""The suite beside other work (issue 62, findings 9 and 10): its clean-up stops only the Ray it started (a user's own
Ray on the same machine, started while the suite runs, is left alone), and a job submitted while the head's job agent
is still starting is submitted again, within a bound."""

import subprocess
import sys
import time

import psutil

from tests.sweep_helpers import RAY_TEMP, env, kill_ray_started_after, submit_job, wait_for

SLEEP = "import subprocess, sys, time; {child}time.sleep(120)"


def spawn(*words: str, child: bool = False) -> subprocess.Popen:
    """A process whose command line carries `words` (as a Ray process's does), optionally with a child of its own."""
    spawn_child = "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); " if child else ""
    return subprocess.Popen([sys.executable, "-c", SLEEP.format(child=spawn_child), *words])


def test_clean_up_stops_the_tests_own_ray_tree_and_spares_a_users_ray():
    started = time.time()
    users = [spawn("/usr/lib/python3/site-packages/ray/core/src/ray/gcs/gcs_server", "--session_dir=/tmp/ray/x"),
             spawn("raylet", "--temp_dir=/tmp/ray")]
    ours = spawn("raylet", f"--session_dir={RAY_TEMP}/session_1", child=True)
    assert wait_for(lambda: len(psutil.Process(ours.pid).children()) == 1, 30)
    (worker,) = psutil.Process(ours.pid).children()  # a worker names no folder: it is found as the raylet's child
    try:
        kill_ray_started_after(started)
        assert wait_for(lambda: ours.poll() is not None and not worker.is_running(), 10)
        assert all(p.poll() is None for p in users)  # a user's Ray: untouched
    finally:
        for p in users + [ours]:
            p.kill()
        if worker.is_running():
            worker.kill()


def test_every_sweep_a_test_starts_keeps_its_ray_under_the_tests_temp_root():
    assert env()["RAY_TMPDIR"] == str(RAY_TEMP)
    assert len(str(RAY_TEMP)) < 24  # Ray's socket paths under it must stay short


# a stand-in for `ray job submit`: no agent for its first N calls (argv[2], counted in a file), then the job runs
SUBMIT = """import sys, time
from pathlib import Path
count = Path(sys.argv[1])
calls = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(calls))
if calls <= int(sys.argv[2]):
    print("Request failed with status code 500: No available agent to submit job, please try again later.")
    sys.exit(1)
print("running"); sys.stdout.flush(); time.sleep(60)
"""


def test_a_job_is_submitted_again_while_the_agent_starts_and_the_retries_are_bounded(tmp_path):
    count = tmp_path / "calls"
    job = submit_job([sys.executable, "-c", SUBMIT, str(count), "2"], tmp_path / "log", env(), tmp_path, pause=0.1,
                     settle=3)
    try:
        assert job.poll() is None and count.read_text() == "3" and "running" in (tmp_path / "log").read_text()
    finally:
        job.kill()
    count.unlink()
    never = submit_job([sys.executable, "-c", SUBMIT, str(count), "99"], tmp_path / "log", env(), tmp_path,
                       attempts=4, pause=0.1, settle=3)
    assert never.returncode == 1 and count.read_text() == "4" and "No available agent" in (tmp_path / "log").read_text()
