"""Helpers for the sweep tests: small experiment files, running the CLI in a subprocess, cleaning up Ray."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent

SMALL = {
    "models": ["tiny-llama"],
    "search_space": {"taylor_seq_len": {"grid": [16, 32, 48]}, "taylor_num_samples": {"grid": [8]},
                     "pruning_method": {"grid": ["taylor", "blockwise"]}},
    "prune": {"sparsity": 0.2, "calibration": "world", "device": "cpu", "dtype": "float32"},
    "evaluation": {"tasks": "piqa", "task_data": "world", "ppl": None, "batch_size": 16, "fidelities": [10]},
    "resources": {"cpu": 1, "gpu": 0},
    "max_failures": 1,
}


def write_experiment(folder: Path, name: str, **changes) -> Path:
    data = {"name": name, **SMALL, "storage_path": str(folder / "sweeps"), **changes}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


FAULTS = Path(__file__).resolve().parent / "faults"  # a sitecustomize that injects faults (see its docstring)
# This test process's Ray temp root (RAY_TMPDIR): every Ray a test starts keeps its session there, so that cleaning up
# stops only what the tests started, never a user's Ray on the same machine. Short: Ray's socket paths must stay short.
RAY_TEMP = Path("/tmp") / f"ttr-{os.getpid()}"


def env(**faults: str) -> dict:
    """The sweep's environment; `faults` (TAYLOR_TUNE_TEST_FAULT / _PAUSE) put the fault injector on PYTHONPATH."""
    extra = {}
    if faults:
        extra = {**faults, "PYTHONPATH": os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")]))}
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1",
            "RAY_TMPDIR": str(RAY_TEMP), **extra}


def sweep_command(experiment: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "taylor_tune", "sweep", str(experiment), *extra]


def run_sweep(experiment: Path, *extra: str, timeout: float = 600, cluster: str | None = None,
              **faults: str) -> subprocess.CompletedProcess:
    """`taylor-tune sweep` in a subprocess: a local Ray of its own, or with `cluster` (a `ray_head` address) the
    driver joins that head as under `ray job submit` (RAY_ADDRESS), its metrics not held for an exporter."""
    joined = {"RAY_ADDRESS": cluster, "TAYLOR_TUNE_METRICS_FLUSH_S": "0"} if cluster else {}
    return subprocess.run(sweep_command(experiment, *extra), capture_output=True, text=True, timeout=timeout,
                          env={**env(**faults), **joined}, cwd=REPO)


def run_sweep_to_end(experiment: Path, *extra: str, cluster: str | None = None) -> subprocess.CompletedProcess:
    """Run a sweep that must finish (exit 0), then stop whatever Ray it started."""
    started = time.time()
    proc = run_sweep(experiment, *extra, cluster=cluster)
    kill_ray_started_after(started)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def shipped_sweep_rows(name: str, storage: Path, cluster: str) -> tuple[Path, list[dict]]:
    """experiments/<name>.yaml run to its end into `storage` on `cluster`: its folder and its trials' rows
    (`analysis_rows`)."""
    run_sweep_to_end(REPO / "experiments" / f"{name}.yaml", "--storage", str(storage), cluster=cluster)
    return storage / name, analysis_rows(storage / name)


def trial_dirs(experiment_dir: Path) -> dict[str, Path]:
    """trial id -> folder, for every trial Tune made. A trial that started in the instant before a SIGKILL, before
    the saved state knew of it, gets a second folder (a new timestamp) when it runs again: the finished one wins."""
    folders: dict[str, Path] = {}
    for p in sorted(experiment_dir.glob("sweep_trainable_*")):  # names end in the start time: later sorts last
        trial_id = "_".join(p.name.split("_")[2:4])
        if p.is_dir() and not (trial_id in folders and (folders[trial_id] / "evaluation.json").is_file()):
            folders[trial_id] = p
    return folders


def finished(experiment_dir: Path) -> dict[str, Path]:
    return {t: p for t, p in trial_dirs(experiment_dir).items() if (p / "evaluation.json").is_file()}


def wait_for(predicate, timeout: float, poll: float = 0.5) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return True
        time.sleep(poll)
    return False


def ray_processes(started_after: float, temp: Path = RAY_TEMP) -> list[psutil.Process]:
    """The Ray processes a test started: those created since `started_after` whose command line names its temp root
    `temp` (GCS, raylet, dashboard, agents: their session folder is under it), and every process they started (a
    worker renames itself `ray::...` and names no folder). A process outside that tree is never included."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline", "create_time"]):
        if proc.info["create_time"] >= started_after - 1 and str(temp) in " ".join(proc.info["cmdline"] or []):
            found[proc.pid] = proc
            try:
                found.update((child.pid, child) for child in proc.children(recursive=True))
            except psutil.Error:
                pass
    return list(found.values())


def kill_ray_started_after(started_after: float, temp: Path = RAY_TEMP) -> None:
    """Stop what a test started (`ray_processes`): a SIGKILLed driver leaves some of its Ray behind."""
    for proc in ray_processes(started_after, temp):
        try:
            proc.kill()
        except psutil.Error:
            pass


# One Ray head for the whole run, shared by the sweeps that only read what they produce: each such sweep joins it
# (RAY_ADDRESS, as under `ray job submit`) instead of starting and stopping a local Ray of its own, whose daemons and
# start-up cost ~8 CPU-s and ~10 s a sweep; an idle head costs ~2 CPU-s a minute, so one for the run, not one per
# worker (BENCHMARKS, eleventh session). Tests of the driver's own lifecycle (signals, faults injected through the
# driver's environment, what a local Ray listens on) keep a local Ray each. Named by the run's controlling process
# (an xdist worker's parent), which stops it at the end (conftest's pytest_sessionfinish); its own temp root, so a
# test's `kill_ray_started_after` never reaches it.
_CONTROLLER = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
HEAD_TEMP = Path("/tmp") / f"ttrh-{_CONTROLLER}-h"  # "-h": no run's root is a prefix of another's


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `ray ...` (Ray's own command line) with every node address of 127.0.0.1 kept on loopback
LOOPBACK_RAY = ("import sys; from ray.scripts.scripts import main; from taylor_tune.compat.ray import on_loopback\n"
                "sys.argv[0] = 'ray'\nwith on_loopback(): main()")


def listeners(processes) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every socket the processes listen on (TCP; psutil reads /proc)."""
    found = []
    for proc in processes:
        try:
            found += [(c.laddr.ip, c.laddr.port, proc.name()) for c in proc.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def shared_head() -> str:
    """The run's head, started by whichever process asks first (every service on 127.0.0.1, two CPUs for each
    worker of the run, workers at the suite's priority); its address."""
    import fcntl

    address = Path(f"{HEAD_TEMP}.address")
    with open(f"{HEAD_TEMP}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if address.is_file() and ray_processes(0, HEAD_TEMP):
            return address.read_text()
        # Ray's fixed defaults (dashboard, its agent, the client server) are any other Ray's on the machine too
        port, dashboard, agent, client = (free_port() for _ in range(4))
        cpus = 2 * int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        # `ray start` turns 127.0.0.1 into the machine's address (its client server then listened there):
        # started with the loopback address kept as given (`compat.ray.on_loopback`), as a local sweep's Ray is
        subprocess.run([sys.executable, "-c", LOOPBACK_RAY, "start", "--head", "--node-ip-address=127.0.0.1",
                        f"--port={port}", f"--num-cpus={cpus}", "--include-dashboard=false",
                        f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={agent}",
                        f"--ray-client-server-port={client}",
                        f"--temp-dir={HEAD_TEMP}", "--disable-usage-stats"],
                       check=True, capture_output=True, timeout=120, cwd=REPO,
                       env={**env(), "RAY_worker_niceness": "0", "RAY_AUTH_MODE": "disabled"})
        address.write_text(f"127.0.0.1:{port}")
        return f"127.0.0.1:{port}"


def stop_head() -> None:
    """Stop the run's head, if one was started, and remove what it kept."""
    import shutil

    kill_ray_started_after(0, HEAD_TEMP)
    wait_for(lambda: not ray_processes(0, HEAD_TEMP), timeout=30)
    for leftover in (f"{HEAD_TEMP}.address", f"{HEAD_TEMP}.lock"):
        Path(leftover).unlink(missing_ok=True)
    shutil.rmtree(HEAD_TEMP, ignore_errors=True)


def submit_job(command: list[str], log_path: Path, job_env: dict, cwd: Path, attempts: int = 30,
               pause: float = 2, settle: float = 10) -> subprocess.Popen:
    """`ray job submit ...` (blocking, its output to `log_path`), submitted again while the head's job agent is still
    starting: right after `ray start` the head answers "No available agent to submit job" at once and starts
    nothing. A submission still running after `settle` seconds went through. Bounded: after `attempts` tries `pause`
    seconds apart the last answer stands."""
    for attempt in range(attempts):
        with open(log_path, "w") as log:
            job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=job_env, cwd=cwd)
        try:
            job.wait(timeout=settle)
        except subprocess.TimeoutExpired:
            return job  # submitted and running
        if "No available agent" not in log_path.read_text() or attempt == attempts - 1:
            return job
        time.sleep(pause)
    raise AssertionError("unreachable")


def _analysis(experiment_dir: Path):
    from ray.tune import ExperimentAnalysis

    return ExperimentAnalysis(str(experiment_dir))


def analysis_rows(experiment_dir: Path) -> list[dict]:
    """ExperimentAnalysis, as a notebook reads it: one dict per trial (last result, config flattened), through JSON
    (missing values None). pandas' to_json keeps 10 decimals by default: a decode speedup of 0.04 (a loaded machine)
    then differs from the searcher's. In the test's process: a fresh one for each call cost ~2 CPU-s of imports."""
    return json.loads(_analysis(experiment_dir).dataframe().to_json(orient="records", double_precision=15))


def terminated(experiment_dir: Path) -> set[str]:
    """Trial ids that Tune's saved experiment state records as finished (TERMINATED)."""
    return {t.trial_id for t in _analysis(experiment_dir).trials if t.status == "TERMINATED"}


RAY_LABELS = {
    "Component",
    "NodeAddress",
    "SessionName",
    "Version",
    "WorkerId",
    "otel_scope_name",
    "otel_scope_schema_url",
    "otel_scope_version",
    "instance",
    "job",
}


def scrape(url: str) -> dict[tuple, float]:
    """One Prometheus scrape: {(sample name, sorted labels): value} for Ray's samples."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name.startswith("ray_")}


def total(samples: dict[tuple, float], name: str, **labels) -> float:
    """Sum of a sample over the series (workers, nodes) whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def screenshot(url: str, path: Path, user_data: Path) -> subprocess.CompletedProcess:
    """A headless Chromium (Debian's) screenshot, with the flags this machine's closed network needs."""
    import shutil

    return subprocess.run(
        [
            shutil.which("chromium"),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={user_data}",
            "--window-size=1400,1000",
            "--virtual-time-budget=15000",
            f"--screenshot={path}",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
