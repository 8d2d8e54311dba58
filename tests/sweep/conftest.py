"""The smoke sweep: 36 trials of the tiny models under `ray job submit`, run once for every test that reads it."""

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import requests

from taylor_tune.errors import ConfigError
from taylor_tune.reporting.status import sweep_status
from tests.sweep_helpers import (
    REPO,
    env,
    free_port,
    kill_ray_started_after,
    scrape,
    screenshot,
    submit_job,
    wait_for,
)

ARTIFACTS = REPO / "test-artifacts"  # kept after the run (CI can upload it): the dashboard screenshot


@pytest.fixture(scope="session")  # one smoke sweep serves every file of tests/sweep
def smoke(tmp_path_factory):
    """The shipped smoke experiment, submitted as a Ray job to a real head node on loopback (its own temp dir,
    token auth disabled for the test, a Prometheus metrics port), into a temporary storage path. While it runs
    the fixture scrapes the metrics endpoint every second (keeping each series' latest value, as Prometheus
    would: a driver's series leave the endpoint when it exits), finds the job through the dashboard's REST
    API, screenshots the dashboard's jobs page with headless Chromium and runs `taylor-tune dashboard`.
    The cluster is stopped afterwards."""
    storage = tmp_path_factory.mktemp("smoke")
    port, dashboard, metrics, agent = free_port(), free_port(), free_port(), free_port()
    temp = Path("/tmp") / f"tt-ray-{os.getpid()}"  # Ray's socket paths must stay short
    # the trials at the priority of the suite (docs/operations.md): Ray's default niceness of 15 starves them beside
    # any CPU-bound process on the machine
    ray_env = {**env(), "RAY_AUTH_MODE": "disabled", "RAY_metrics_report_interval_ms": "1000",
               "RAY_worker_niceness": "0"}
    bin_dir = Path(os.sys.executable).parent
    run = SimpleNamespace(
        path=storage / "smoke",
        samples={},
        jobs=[],
        screenshot=None,
        screenshot_error=None,
        dashboard_cli=None,
        statuses=[],
    )
    started = time.time()
    log_path = tmp_path_factory.mktemp("smoke-log") / "job.log"
    try:
        subprocess.run([str(bin_dir / "ray"), "start", "--head", f"--port={port}", "--dashboard-host=127.0.0.1",
                        f"--dashboard-port={dashboard}", f"--metrics-export-port={metrics}", "--num-cpus=2",
                        # the job agent's own port: Ray's fixed default (52365) is taken by any other Ray on the
                        # machine (a user's sweep), and the head then answers every submission "No available agent"
                        f"--dashboard-agent-listen-port={agent}",
                        f"--temp-dir={temp}", "--disable-usage-stats"],
                       check=True, env=ray_env, capture_output=True, timeout=120)
        # the driver holds its last values long enough for the metrics agent to export them: a cluster's default
        # (4 s fell short once under load, 8 s once beside other work: Ray exports every 10 s)
        runtime_env = json.dumps({"env_vars": {"TAYLOR_TUNE_METRICS_FLUSH_S": "12"}})
        job = submit_job([str(bin_dir / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{dashboard}",
                          "--runtime-env-json", runtime_env, "--", str(bin_dir / "taylor-tune"), "sweep",
                          str(REPO / "experiments" / "smoke.yaml"), "--storage", str(storage)],
                         log_path, ray_env, REPO)
        deadline = time.time() + 1700  # ~3.5 min on a quiet machine; a busy one (issue 62, must-show 5) takes longer
        while job.poll() is None and time.time() < deadline:
            try:
                run.samples.update(scrape(f"http://127.0.0.1:{metrics}/metrics"))
                run.jobs = requests.get(f"http://127.0.0.1:{dashboard}/api/jobs/", timeout=5).json()
            except (OSError, ValueError):
                pass  # the agent or the dashboard is still starting
            if run.path.is_dir():  # `taylor-tune status` while the sweep runs, as a user would watch it
                try:
                    run.statuses.append(sweep_status(str(run.path)))
                except ConfigError:
                    pass  # no state saved yet
            running = [
                j
                for j in run.jobs
                if "taylor-tune sweep" in j.get("entrypoint", "") and j.get("status") == "RUNNING"
            ]
            if running and run.dashboard_cli is None:
                run.dashboard_cli = subprocess.run(
                    [str(bin_dir / "taylor-tune"), "dashboard", str(run.path)],
                    capture_output=True,
                    text=True,
                    timeout=120,
                    env={**ray_env, "RAY_ADDRESS": f"127.0.0.1:{port}"},
                )
            if running and run.screenshot is None and run.screenshot_error is None:
                if shutil.which("chromium") is None:
                    run.screenshot_error = "Debian's chromium is not installed"
                else:
                    ARTIFACTS.mkdir(exist_ok=True)
                    shot = screenshot(f"http://127.0.0.1:{dashboard}/#/jobs", ARTIFACTS / "ray_dashboard_jobs.png",
                                      tmp_path_factory.mktemp("chromium"))
                    run.screenshot = ARTIFACTS / "ray_dashboard_jobs.png"
                    run.screenshot_error = None if shot.returncode == 0 else shot.stderr[-2000:]
            time.sleep(1)
        if job.poll() is None:
            job.kill()
        job.wait()
        run.samples.update(scrape(f"http://127.0.0.1:{metrics}/metrics"))
    finally:
        kill_ray_started_after(started, temp)  # the head node's processes and everything they started
    assert wait_for(
        lambda: not [p for p in psutil.process_iter(["cmdline"]) if str(temp) in " ".join(p.info["cmdline"] or [])], 30
    )
    run.stdout = log_path.read_text()
    assert job.returncode == 0, run.stdout[-3000:]
    assert "succeeded" in run.stdout
    return run
