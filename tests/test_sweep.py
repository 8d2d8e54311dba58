"""The sweep service end to end: real local Ray, real Tune, the offline world's tiny models."""

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import psutil
import pytest
import requests

from taylor_tune.errors import ConfigError
from taylor_tune.reporting import build_report, load_trials
from taylor_tune.reporting.stats import best_trial
from taylor_tune.sweep.status import sweep_status
from tests.sweep_helpers import (
    REPO,
    SMALL,
    analysis_rows,
    env,
    finished,
    kill_ray_started_after,
    run_sweep,
    run_sweep_to_end,
    scrape,
    screenshot,
    sweep_command,
    terminated,
    total,
    trial_dirs,
    wait_for,
    write_experiment,
)

ARTIFACTS = REPO / "test-artifacts"  # kept after the run (CI can upload it): the dashboard screenshot

SPEC_COLUMNS = ["output_dir", "ppl", "acc_mean", *[f"acc_{t}" for t in ("boolq", "piqa", "hellaswag", "winogrande",
                "arc_easy", "arc_challenge", "openbookqa")], "params_count", "pruning_ratio", "grad_mean_ratio",
                "grad_norm_ratio", "grad_mean_range", "grad_norm_range", "extreme_pruning_layers", "pruning_method",
                "taylor_seq_len", "taylor_num_samples"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


pytestmark = pytest.mark.slow  # every test here runs Ray sweeps


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The shipped smoke experiment, submitted as a Ray job to a real head node on loopback (its own temp dir,
    token auth disabled for the test, a Prometheus metrics port), into a temporary storage path. While it runs
    the fixture scrapes the metrics endpoint every second (keeping each series' latest value, as Prometheus
    would: a driver's series leave the endpoint when it exits), finds the job through the dashboard's REST
    API, screenshots the dashboard's jobs page with headless Chromium and runs `taylor-tune dashboard`.
    The cluster is stopped afterwards."""
    storage = tmp_path_factory.mktemp("smoke")
    port, dashboard, metrics = free_port(), free_port(), free_port()
    temp = Path("/tmp") / f"tt-ray-{os.getpid()}"  # Ray's socket paths must stay short
    ray_env = {**env(), "RAY_AUTH_MODE": "disabled", "RAY_metrics_report_interval_ms": "1000"}
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
                        f"--temp-dir={temp}", "--disable-usage-stats"],
                       check=True, env=ray_env, capture_output=True, timeout=120)
        runtime_env = json.dumps({"env_vars": {"TAYLOR_TUNE_METRICS_FLUSH_S": "4"}})  # the driver's last values get out
        with open(log_path, "w") as log:
            job = subprocess.Popen(
                [
                    str(bin_dir / "ray"),
                    "job",
                    "submit",
                    "--address",
                    f"http://127.0.0.1:{dashboard}",
                    "--runtime-env-json",
                    runtime_env,
                    "--",
                    str(bin_dir / "taylor-tune"),
                    "sweep",
                    str(REPO / "experiments" / "smoke.yaml"),
                    "--storage",
                    str(storage),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=ray_env,
                cwd=REPO,
            )
            deadline = time.time() + 900
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
        kill_ray_started_after(started)  # the head node's processes and everything they started, by PID
    assert wait_for(
        lambda: not [p for p in psutil.process_iter(["cmdline"]) if str(temp) in " ".join(p.info["cmdline"] or [])], 30
    )
    run.stdout = log_path.read_text()
    assert job.returncode == 0, run.stdout[-3000:]
    assert "succeeded" in run.stdout
    return run


def test_status_while_the_sweep_runs_counts_its_running_trials(smoke):
    """Ray's Trial loads a saved RUNNING as PENDING; status must not: the head has 2 CPUs and a trial takes 1."""
    polls = [s for s in smoke.statuses if s["total"]]
    assert len(polls) >= 10, len(polls)
    for status in polls:
        assert (
            status["pending"] + status["running"] + status["finished"] + status["errored"] + status["paused"]
            == status["total"]
            <= 36
        )
        assert 0 <= status["running"] <= 2 and status["saved_s_ago"] < 30
    assert max(s["running"] for s in polls) >= 1
    assert [s["finished"] for s in polls] == sorted(s["finished"] for s in polls)  # never goes back
    final = sweep_status(str(smoke.path))
    assert (final["finished"], final["running"], final["pending"]) == (36, 0, 0)


def test_status_of_a_finished_sweep_loads_neither_torch_nor_ray(smoke):
    """`taylor-tune status` reads JSON: run in a fresh process, it leaves torch and ray out of sys.modules."""
    import sys

    code = ("import json, sys; from taylor_tune.cli import main; code = main(['status', sys.argv[1]]); "
            "print(json.dumps([code, 'torch' in sys.modules, 'ray' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code, str(smoke.path)], capture_output=True, text=True, check=True)
    assert "finished 36" in done.stdout
    assert json.loads(done.stdout.splitlines()[-1]) == [0, False, False]


def test_smoke_sweep_runs_end_to_end_under_ray_job_submit_and_analysis_has_every_column(smoke):
    path = smoke.path
    assert "36 finished, 0 errored" in smoke.stdout
    rows = analysis_rows(path)
    assert len(rows) == 36
    for row in rows:
        missing = [c for c in SPEC_COLUMNS if row.get(c) is None]
        assert not missing, missing
        assert 0.19 < row["pruning_ratio"] < 0.21 and row["stage"] == "zero_shot_40"
        assert row["scorer"] == "prefix" and row["zero_shot_40_tokens"] > 0
        assert Path(row["output_dir"]).parent == path and (Path(row["output_dir"]) / "pruning_summary.json").is_file()
        written = json.loads((Path(row["output_dir"]) / "config.json").read_text())[
            "prune"
        ]  # reused workers: own folder
        assert (written["method"], written["seq_len"], written["num_samples"]) == (
            row["pruning_method"], row["taylor_seq_len"], row["taylor_num_samples"])
    grid = {(r["model"], r["pruning_method"], r["taylor_seq_len"], r["taylor_num_samples"]) for r in rows}
    assert len(grid) == 36


def test_the_console_is_one_line_per_trial_and_a_few_status_lines(smoke):
    """Tune's own tables (a config table per trial start, a result table per report) stay off without -v."""
    lines = smoke.stdout.splitlines()
    trial_lines = [line for line in lines if re.match(r"\[\d+/36\] ", line)]
    assert len(trial_lines) == 36, "\n".join(lines[:80])
    assert all(
        re.search(r"seq_len=\d+ samples=\d+: ppl [\d.]+, acc_mean \d\.\d{4}, decode [\d.]+x, \d+ s$", line)
        for line in trial_lines
    ), trial_lines
    assert len({line.split(":")[0].split("] ")[1] for line in trial_lines}) == 36  # each configuration once
    assert len(lines) <= 120, "\n".join(lines)
    assert not any("Trial status" in line or "╭" in line for line in lines)


def test_tensorboard_has_the_per_stage_metrics(smoke):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = smoke.path
    trial = next(path.glob("sweep_trainable_*"))
    tags = set()
    for events in trial.glob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"])
    for metric in ("pruning_ratio", "grad_norm_ratio", "ppl", "acc_mean", "acc_piqa"):
        assert f"ray/tune/{metric}" in tags, sorted(tags)


def test_importance_passes_equal_distinct_model_seq_len_seed(smoke):
    path = smoke.path
    events = [json.loads(l) for l in (path / "importance_cache" / "events.jsonl").read_text().splitlines()]
    computed = [e for e in events if e["event"] == "computed"]
    distinct = {(r["model"], r["taylor_seq_len"], r["seed"]) for r in analysis_rows(path)}
    assert len(computed) == len(distinct) == 6  # 3 models x 2 seq_lens x 1 seed, shared by methods and sample counts
    assert sum(e["event"] == "hit" for e in events) == 36 - 6


def test_status_reports_counts_and_best_per_model(smoke):
    path = smoke.path
    proc = subprocess.run(
        [os.sys.executable, "-m", "taylor_tune", "status", str(path)], capture_output=True, text=True, env=env()
    )
    assert proc.returncode == 0
    assert "finished 36, errored 0" in proc.stdout
    best_line = r"^best so far for (\S+) by acc_mean: .*\(trial (\S+)\); decode ([\d.]+)x the unpruned model, memory"
    named = {model: trial for model, trial, _ in re.findall(best_line, proc.stdout, flags=re.M)}
    table = load_trials(path)  # the report's reading and tie rule name the same best trial per model
    assert named == {model: best_trial(rows)["trial_id"] for model, rows in table.valid.groupby("model")}
    assert len(named) == 3


class _Planted:
    """A pickle that creates a file when it is loaded: what someone who can write to shared storage could plant."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_status_and_report_run_no_code_planted_in_the_experiment_state(smoke, tmp_path):
    """Ray keeps some trial fields as cloudpickle blobs in experiment_state-*.json, and its own readers load them:
    status and report read the folder as JSON only, so a planted blob stays unread."""
    import pickle

    folder = tmp_path / "smoke"
    shutil.copytree(smoke.path, folder)
    marker = tmp_path / "planted-code-ran"
    blob = {"_type": "CLOUDPICKLE_FALLBACK", "value": pickle.dumps(_Planted(marker)).hex()}
    (state_file,) = folder.glob("experiment_state-*.json")
    saved = json.loads(state_file.read_text())
    trial, runtime = (json.loads(part) for part in saved["trial_data"][0])
    trial["storage"], runtime["checkpoint_manager"] = blob, blob
    saved["trial_data"][0] = [json.dumps(trial), json.dumps(runtime)]
    state_file.write_text(json.dumps(saved))
    for command in (["status", str(folder)], ["report", str(folder), "--output", str(tmp_path / "report")]):
        proc = subprocess.run([os.sys.executable, "-m", "taylor_tune", *command], capture_output=True, text=True,
                              env=env())
        assert proc.returncode == 0, proc.stderr
        assert not marker.exists(), f"{command[0]} ran code from the experiment folder"
    assert "finished 36, errored 0" in proc.stdout or "36 trials" in proc.stdout


def interrupt_sweep(experiment, log_path, until, sig, settle: float = 3, **faults) -> int:
    """Run the sweep until `until()` holds, let the experiment state be saved (every second; `settle` seconds),
    send `sig`, and stop every Ray process the run started; the driver's exit code."""
    started = time.time()
    log = open(log_path, "w")  # a file, not a pipe: nobody reads a pipe while we wait
    proc = subprocess.Popen(
        sweep_command(experiment), stdout=log, stderr=subprocess.STDOUT, env=env(**faults), cwd=REPO
    )
    try:
        assert wait_for(until, timeout=300, poll=0.05), f"the sweep never got there: {log_path.read_text()[-2000:]}"
        time.sleep(settle)
        proc.send_signal(sig)
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
        kill_ray_started_after(started)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_an_interrupted_sweep_resumes_without_rerunning_finished_trials(sig, tmp_path):
    # 12 trials one at a time: with reused workers a trial takes about a second, so the interruption (2 finished
    # + 2.5 s for the saved state) must leave most of the grid still to run
    space = {"taylor_seq_len": {"grid": [16, 32, 48]}, "taylor_num_samples": {"grid": [8, 16]},
             "pruning_method": {"grid": ["taylor", "blockwise"]}}
    experiment = write_experiment(
        tmp_path, "resume", search_space=space, search={"algorithm": "grid", "max_concurrent": 1}
    )
    path = tmp_path / "sweeps" / "resume"
    started = time.time()
    code = interrupt_sweep(
        experiment, tmp_path / "first-run.log", lambda: len(finished(path)) >= 2, sig
    )  # two trials finished
    if sig == signal.SIGTERM:  # stopped gracefully with trials not run: EXIT_NOT_DONE, not success
        assert code == 4, (tmp_path / "first-run.log").read_text()[-2000:]
    # finished = what Tune's saved state records as TERMINATED: a trial whose files were uploaded in the instant
    # before a SIGKILL, but whose completion the driver had not yet saved, is in flight and may run again
    before = {t: (trial_dirs(path)[t] / "result.json").read_bytes() for t in terminated(path)}
    assert 2 <= len(before) < 12, "the sweep must be interrupted part-way for this test to mean anything"

    again = run_sweep(experiment)
    kill_ray_started_after(started)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    after = finished(path)
    assert set(after) == set(trial_dirs(path)) and len(after) == 12  # the rest completed, no extra trials
    for trial_id, result in before.items():
        assert (after[trial_id] / "result.json").read_bytes() == result  # not rerun: results untouched
    rows = analysis_rows(path)
    assert {(r["pruning_method"], r["taylor_seq_len"], r["taylor_num_samples"]) for r in rows} == {
        (m, s, n) for m in ("taylor", "blockwise") for s in (16, 32, 48) for n in (8, 16)}
    table = load_trials(path)  # a re-run trial's first, partial folder does not count as a broken trial
    assert len(table.valid) == 12 and table.invalid.empty


@pytest.mark.parametrize("settle", [3, 0], ids=["state-saved", "killed-at-once"])
def test_a_trial_killed_after_its_final_report_is_not_recomputed_on_resume(tmp_path, settle):
    """SIGKILL in the window between a trial's final report (its artifacts complete) and Tune recording it finished
    (a test hook holds the trial there): the rerun reports the finished artifacts instead of computing again. At once:
    before the driver's saved state (every second) holds the final report's checkpoint; the copy in the trial's
    storage folder serves."""
    space = {
        "taylor_seq_len": {"grid": [16]},
        "taylor_num_samples": {"grid": [8]},
        "pruning_method": {"grid": ["taylor", "blockwise"]},
    }
    experiment = write_experiment(
        tmp_path, "idem", search_space=space, search={"algorithm": "grid", "max_concurrent": 1}
    )
    path, markers = tmp_path / "sweeps" / "idem", tmp_path / "paused"
    markers.mkdir()
    started = time.time()
    interrupt_sweep(experiment, tmp_path / "first-run.log", lambda: any(markers.iterdir()), signal.SIGKILL, settle,
                    TAYLOR_TUNE_TEST_PAUSE=str(markers))  # a trial held after its final report
    (paused,) = [p.name for p in markers.iterdir()]
    assert paused not in terminated(path)  # Tune had not recorded it finished: a restore runs it again

    again = run_sweep(experiment)
    kill_ray_started_after(started)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    rows = {row["trial_id"]: row for row in analysis_rows(path)}
    assert len(rows) == 2 and rows[paused]["reused_artifacts"] is True and rows[paused]["stage"] == "zero_shot_10"
    other = next(t for t in rows if t != paused)
    assert not rows[other].get("reused_artifacts")
    # one importance pass (the paused trial's first run) and one hit (the other trial): the rerun touched no gradient
    events = [
        json.loads(line)["event"] for line in (path / "importance_cache" / "events.jsonl").read_text().splitlines()
    ]
    assert events == ["computed", "hit"]
    assert (trial_dirs(path)[paused] / "evaluation.json").is_file()


def test_a_failing_trial_is_retried_then_errored_and_the_rest_finish(tmp_path):
    fault = {"pruning_method": "blockwise", "taylor_seq_len": 32}
    experiment = write_experiment(tmp_path, "faulty", max_failures=2)
    started = time.time()
    proc = run_sweep(experiment, TAYLOR_TUNE_TEST_FAULT=json.dumps(fault))
    kill_ray_started_after(started)
    assert proc.returncode == 3, proc.stderr[-2000:]  # EXIT_ERRORED: the sweep ended, a trial errored
    assert "5 finished, 1 errored" in proc.stdout and "\x1b[" not in proc.stdout  # no terminal colour codes
    # the summary names the trial and its exception with its message (it showed Ray's task name, coloured)
    assert re.search(r"^  errored trial tiny-llama blockwise seq_len=32 samples=\d+: .*InjectedFault: injected fault",
                     proc.stdout, re.M), proc.stdout
    assert re.search(
        r"^\[\d/6\] tiny-llama blockwise seq_len=32 samples=\d+: errored: .*InjectedFault: injected fault",
        proc.stdout,
        re.M,
    ), proc.stdout
    path = tmp_path / "sweeps" / "faulty"
    (bad,) = [
        p for p in trial_dirs(path).values() if "pruning_method=blockwise" in p.name and "taylor_seq_len=32" in p.name
    ]
    errors = (bad / "error.txt").read_text()  # Tune's own record: one entry per failed attempt
    assert (
        errors.count("Failure # ") == 3 and errors.count("InjectedFault: injected fault") == 3
    )  # first try + 2 retries
    assert len(finished(path)) == 5
    report = build_report(path)  # the errored trial is counted with its reason, never crashes the report
    (reason,) = report.table.invalid["reason"]
    assert reason.startswith("errored: ") and "InjectedFault: injected fault" in reason and len(report.table.valid) == 5


def test_tpe_with_asha_runs_one_study_per_model(tmp_path):
    experiment = write_experiment(
        tmp_path,
        "tpe",
        models=["tiny-llama", "tiny-qwen2"],
        search_space={
            "taylor_seq_len": {"choice": [16, 32, 48]},
            "taylor_num_samples": {"choice": [8, 16]},
            "pruning_method": {"choice": ["taylor", "layerwise", "blockwise"]},
        },
        search={"algorithm": "tpe", "num_trials": 3, "scheduler": "asha", "seed": 0, "reduction_factor": 3},
        evaluation={
            "tasks": "arc_challenge,openbookqa",
            "task_data": "world",
            "ppl": None,
            "batch_size": 16,
            "fidelities": [5, 20],
        },
    )
    started = time.time()
    proc = run_sweep(experiment)
    kill_ray_started_after(started)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = analysis_rows(tmp_path / "sweeps" / "tpe")
    assert sorted(r["model"] for r in rows) == ["tiny-llama"] * 3 + ["tiny-qwen2"] * 3
    assert all(r["stage"] in ("zero_shot_5", "zero_shot_20") for r in rows)  # ASHA may stop after the cheap pass
    assert all(r["zero_shot_pass"] == (r["stage"] == "zero_shot_20") for r in rows)  # the scheduler's clock: pass 0, 1
    assert all(r["taylor_seq_len"] in (16, 32, 48) and r["taylor_num_samples"] in (8, 16) for r in rows)
    status = sweep_status(str(tmp_path / "sweeps" / "tpe"))  # best so far: full evaluations only, not ASHA's cheap pass
    final = [r for r in rows if r["stage"] == "zero_shot_20"]
    full = {m: max(r["acc_mean"] for r in final if r["model"] == m) for m in {r["model"] for r in final}}
    assert {m: b["acc_mean"] for m, b in status["best"].items()} == full
    for model in ("tiny-llama", "tiny-qwen2"):  # a study never runs a configuration twice
        keys = [
            (r["taylor_seq_len"], r["taylor_num_samples"], r["pruning_method"]) for r in rows if r["model"] == model
        ]
        assert len(set(keys)) == 3
    table = load_trials(tmp_path / "sweeps" / "tpe")  # trials ASHA stopped at the cheap fidelity are not comparable
    stopped = [r for r in rows if r["stage"] == "zero_shot_5"]
    assert len(table.invalid) == len(stopped) and all(
        "stopped early by the scheduler" in r for r in table.invalid["reason"]
    )


def test_a_multi_objective_tpe_sweep_searches_any_setting_and_reports_the_front(tmp_path):
    import pickle

    from tests.test_pareto import brute_force

    experiment = write_experiment(
        tmp_path, "pareto",
        search_space={"pruning_method": {"choice": ["taylor", "random"]}, "sparsity": {"choice": [0.1, 0.2, 0.3]},
                      "uniform": {"choice": [False, True]}},
        prune={k: v for k, v in SMALL["prune"].items() if k != "sparsity"},
        search={"algorithm": "tpe", "num_trials": 5, "n_startup_trials": 2, "seed": 0},
        objectives=[{"metric": "acc_mean"}, {"metric": "decode_speedup"}],
        evaluation={**SMALL["evaluation"], "speed": {"prefill_batch": 1, "prefill_len": 16, "decode_batch": 2,
                                                     "prompt_len": 8, "new_tokens": 4, "repeats": 1, "warmup": 0}},
    )
    proc = run_sweep_to_end(experiment)
    folder = tmp_path / "sweeps" / "pareto"
    rows = analysis_rows(folder)
    keys = {(r["pruning_method"], r["sparsity"], r["uniform"]) for r in rows}
    assert len(rows) == 5 and len(keys) == 5  # five distinct configurations of the space, each run once
    assert all(r["taylor_seq_len"] == 64 and r["taylor_num_samples"] == 128 for r in rows)  # unsearched: defaults
    assert all(r["decode_speedup"] > 0 and 0 <= r["acc_mean"] <= 1 for r in rows)
    assert all(f"sparsity={r['sparsity']}" in proc.stdout for r in rows)  # the console names what was searched
    # one multi-objective Optuna study per model, told both values of every trial
    with open(sorted(folder.glob("searcher-state-*.pkl"))[-1], "rb") as f:
        study = pickle.load(f)["studies"]["tiny-llama"].study  # our own sweep's file, written by this test
    assert len(study.directions) == 2
    told = {tuple(t.params[k] for k in ("pruning_method", "sparsity", "uniform")): t.values for t in study.trials
            if t.state.name == "COMPLETE"}
    reported = {(r["pruning_method"], r["sparsity"], r["uniform"]): [r["acc_mean"], r["decode_speedup"]] for r in rows}
    assert {k: told[k] for k in keys} == {k: pytest.approx(v, rel=1e-9) for k, v in reported.items()}
    # the report: the front of the kept results equals a brute-force filter of them; the best under a constraint
    out = tmp_path / "report"
    report = subprocess.run([*sweep_command(folder)[:3], "report", str(folder), "--output", str(out),
                             "--constraint", "decode_speedup>=0.5"], capture_output=True, text=True, env=env())
    assert report.returncode == 0, report.stderr
    kept = pd.read_csv(out / "consolidated_tiny-llama" / "all_methods_results.csv")
    front = pd.read_csv(out / "consolidated_tiny-llama" / "pareto_front.csv")
    expected, dominators = brute_force(kept, [("acc_mean", "max"), ("decode_speedup", "max")])
    assert set(front.loc[front["on_front"], "point"]) == expected and "Pareto front" in report.stdout
    assert {p: sorted(str(d).split(";")) if isinstance(d, str) else [] for p, d in
            zip(front["point"], front["dominated_by"])} == dominators
    best = json.loads((out / "consolidated_tiny-llama" / "best_under_constraints.json").read_text())
    meeting = kept[kept["decode_speedup"] >= 0.5].sort_values(["acc_mean", "trial_id"], ascending=[False, True])
    assert best["best"]["point"] == meeting["trial_id"].iloc[0] and best["satisfying"] == len(meeting)
    assert (out / "figures" / "pareto_tiny-llama.png").is_file()
    refused = subprocess.run([*sweep_command(folder)[:3], "report", str(folder), "--output", str(out),
                              "--constraint", "speed>=1"], capture_output=True, text=True, env=env())
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "'speed' is not a column" in refused.stderr


def test_a_sweep_for_the_lowest_perplexity_is_ranked_by_it_in_tune_status_and_report(tmp_path):
    experiment = write_experiment(tmp_path, "ppl", metric="ppl", mode="min",
                                  evaluation={**SMALL["evaluation"], "ppl": "world", "ppl_max_windows": 4})
    started = time.time()
    proc = run_sweep(experiment)
    kill_ray_started_after(started)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    path = tmp_path / "sweeps" / "ppl"
    rows = analysis_rows(path)
    assert len(rows) == 6 and len({r["ppl"] for r in rows}) > 1
    lowest = min(rows, key=lambda r: (r["ppl"], -r["acc_mean"]))
    from ray.tune import ExperimentAnalysis

    tune_best = ExperimentAnalysis(str(path)).get_best_trial(metric="ppl", mode="min", scope="last")
    assert tune_best.trial_id == lowest["trial_id"]
    status = sweep_status(str(path))["best"]["tiny-llama"]
    assert (status["metric"], status["trial_id"]) == ("ppl", lowest["trial_id"]) and status["ppl"] == pytest.approx(
        lowest["ppl"]
    )
    report = build_report(str(path))
    assert report.objective.metric == "ppl" and report.models["tiny-llama"].best["trial_id"] == lowest["trial_id"]
    out = subprocess.run(
        [os.sys.executable, "-m", "taylor_tune", "status", str(path)], capture_output=True, text=True, env=env()
    )
    assert f"best so far for tiny-llama by ppl: ppl {status['ppl']:.3f}" in out.stdout


def test_the_best_gauge_of_a_perplexity_sweep_keeps_each_models_lowest_final_value():
    """The smoke sweep checks the gauge by a real scrape under acc_mean / max; here its rule under ppl / min."""
    from taylor_tune.sweep.tune.metrics import SweepMetricsCallback

    callback = SweepMetricsCallback("ppl", "zero_shot_all", "ppl", "min", flush_s=0)
    results = [("a", "zero_shot_all", 50.0), ("a", "zero_shot_5", 10.0), ("a", "zero_shot_all", 40.0),
               ("a", "zero_shot_all", 45.0), ("b", "zero_shot_all", 70.0), ("b", "zero_shot_all", 90.0)]
    for model, stage, ppl in results:
        callback.on_trial_result(0, [], None, {"model": model, "stage": stage, "ppl": ppl, "acc_mean": 0.9 - ppl / 100})
    final = [(m, v) for m, stage, v in results if stage == "zero_shot_all"]
    assert callback.best == {m: min(v for n, v in final if n == m) for m, _ in final}


def test_report_on_the_smoke_sweep_writes_every_file_with_the_numbers_ray_reads(smoke, tmp_path):
    import pandas as pd

    from tests.test_reporting import tabular_rows_are_well_formed

    path = smoke.path
    out = tmp_path / "report"
    proc = subprocess.run([os.sys.executable, "-m", "taylor_tune", "report", str(path), "--output", str(out)],
                          capture_output=True, text=True, env=env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "36 trials (36 valid, 0 invalid)" in proc.stdout
    df = pd.DataFrame(analysis_rows(path))  # Ray's own reading of the experiment, the independent side
    for model, rows in df.groupby("model"):
        best = rows.loc[rows["acc_mean"].idxmax()]
        written = json.loads((out / f"consolidated_{model}" / "global_best_config.json").read_text())
        assert written["metrics"]["acc_mean"] == pytest.approx(best["acc_mean"])
        top = rows[rows["acc_mean"] == best["acc_mean"]]  # ties at the top are possible on 40 items
        assert written["config"]["pruning_method"] in set(top["pruning_method"])
        methods = json.loads((out / f"consolidated_{model}" / "method_comparison.json").read_text())["methods"]
        for method, group in rows.groupby("pruning_method"):
            assert methods[method]["mean"] == pytest.approx(group["acc_mean"].mean()) and methods[method][
                "count"
            ] == len(group)
        heat = json.loads((out / "figures" / f"heatmap_{model}.json").read_text())
        means = rows.groupby(["taylor_seq_len", "taylor_num_samples"])["acc_mean"].mean()
        for i, s in enumerate(heat["seq_lens"]):
            for j, n in enumerate(heat["num_samples"]):
                assert heat["values"][i][j] == pytest.approx(means[(s, n)])
        csv = pd.read_csv(out / f"consolidated_{model}" / "all_methods_results.csv")
        assert len(csv) == len(rows) and {"ppl", "acc_mean", "acc_piqa", "grad_norm_ratio", "output_dir"} <= set(
            csv.columns
        )
        best_dir = out / f"best_{model}"
        for f in ("best_config.json", "evaluation/evaluation_results.json", "analysis/gradient_diagnosis.json",
                  "analysis/pruning_comparison.json", "artifacts/config.json", "visualization/gradient_analysis.png",
                  "visualization/pruning_ratio.png", "visualization/retention_ratio.png"):
            assert (best_dir / f).is_file() and (best_dir / f).stat().st_size > 0, f
        layers = json.loads((best_dir / "visualization" / "layer_profile.json").read_text())
        source = json.loads((Path(written["metrics"]["output_dir"]) / "layer_analysis.json").read_text())
        assert layers["pruning_ratio"] == [r["pruning_ratio"] for r in source]
    bars = json.loads((out / "figures" / "methods_by_models.json").read_text())
    for k, method in enumerate(bars["methods"]):
        for j, model in enumerate(bars["models"]):
            assert bars["means"][k][j] == pytest.approx(
                df[(df["model"] == model) & (df["pruning_method"] == method)]["acc_mean"].mean()
            )
    text = (out / "final_analysis_report.txt").read_text()
    assert (
        "Perplexity vs acc_mean" in text
        and "Overall best by acc_mean:" in text
        and (out / "final_analysis_report.md").is_file()
    )
    tex = (out / "paper" / "tables.tex").read_text()
    tabular_rows_are_well_formed(tex)
    if shutil.which("pdflatex"):
        latex = subprocess.run(
            ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "tables.tex"],
            cwd=out / "paper",
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert latex.returncode == 0, latex.stdout[-2000:]


def test_the_example_notebook_runs_headless_on_the_smoke_sweep(smoke, tmp_path):
    import nbclient
    import nbformat

    path = smoke.path
    notebook = nbformat.read(REPO / "dashboards" / "explore_experiment.ipynb", as_version=4)
    os.environ["TAYLOR_TUNE_EXPERIMENT"], os.environ["TAYLOR_TUNE_REPORT"] = str(path), str(tmp_path / "nb-report")
    try:
        nbclient.NotebookClient(
            notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
        ).execute()
    finally:
        del os.environ["TAYLOR_TUNE_EXPERIMENT"], os.environ["TAYLOR_TUNE_REPORT"]
    printed = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs)
    assert "36 trials in" in printed and printed.count("lead real:") == 3
    assert (tmp_path / "nb-report" / "final_analysis_report.txt").is_file()


# ---------------------------------------------------------------- operations: metrics, dashboards (issue 6)

GPU_ONLY = {"ray_taylor_tune_trial_peak_gpu_memory_bytes", "ray_node_gpus_utilization", "ray_node_gram_used"}


def test_the_custom_metrics_carry_the_sweeps_numbers(smoke):
    samples, rows = smoke.samples, analysis_rows(smoke.path)
    assert total(samples, "ray_taylor_tune_trials", experiment="smoke", state="finished") == 36 == len(rows)
    assert total(samples, "ray_taylor_tune_trials", experiment="smoke", state="errored") == 0
    assert total(samples, "ray_taylor_tune_trials", experiment="smoke", state="running") == 0
    distinct = {(r["model"], r["taylor_seq_len"], r["seed"]) for r in rows}
    assert total(samples, "ray_taylor_tune_importance_cache_events_total", event="computed") == len(distinct) == 6
    assert total(samples, "ray_taylor_tune_importance_cache_events_total", event="hit") == 36 - 6
    for stage, trials in (
        ("load", 36),
        ("calibration", 6),
        ("importance", 36),
        ("prune", 36),
        ("ppl", 36),
        ("zero_shot_40", 36),
    ):
        assert total(samples, "ray_taylor_tune_stage_runs_total", stage=stage) == trials, stage
    for stage in ("importance", "ppl", "zero_shot_40"):  # the seconds the trials reported, summed
        seconds = sum(r[f"{stage}_s"] for r in rows)
        assert total(samples, "ray_taylor_tune_stage_seconds_total", stage=stage) == pytest.approx(seconds, rel=1e-4), (
            stage
        )
    for model in ("tiny-llama", "tiny-qwen2", "tiny-mistral"):
        best = max(r["acc_mean"] for r in rows if r["model"] == model)
        assert total(samples, "ray_taylor_tune_best", model=model, metric="acc_mean", mode="max") == pytest.approx(best)


def test_every_metric_the_grafana_dashboard_queries_is_in_the_scrape(smoke):
    dashboard = json.loads((REPO / "dashboards" / "taylor_tune.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    queried = {name for e in exprs for name in re.findall(r"\b(ray_[a-z0-9_]+)", e)}
    scraped = {name for name, _ in smoke.samples}
    assert {"ray_taylor_tune_trials", "ray_taylor_tune_stage_seconds_total", "ray_node_cpu_utilization"} <= queried
    missing = queried - scraped - GPU_ONLY  # the GPU panels need a GPU node; that is all they miss on this machine
    assert not missing, missing
    for p in dashboard["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]


def test_the_job_is_found_through_the_rest_api_and_its_dashboard_page_screenshotted(smoke):
    (job,) = [j for j in smoke.jobs if "taylor-tune sweep" in j.get("entrypoint", "")]
    assert "experiments/smoke.yaml" in job["entrypoint"] and job["submission_id"].startswith("raysubmit_")
    if smoke.screenshot_error == "Debian's chromium is not installed":
        pytest.skip(smoke.screenshot_error)
    assert smoke.screenshot_error is None, smoke.screenshot_error
    png = smoke.screenshot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000  # a rendered page, not an empty canvas


def test_dashboard_command_prints_the_running_clusters_urls(smoke):
    proc = smoke.dashboard_cli
    assert proc is not None and proc.returncode == 0, proc and proc.stderr[-2000:]
    lines = {line[:14].strip(): line[15:] for line in proc.stdout.splitlines()}  # "{name:14s} {url}"
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/#/jobs", lines["ray dashboard"])
    assert "var-experiment=smoke" in lines["grafana"] and str(smoke.path) in lines["tensorboard"]


LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_local_sweep_listens_on_loopback_only_and_stops_what_it_started(tmp_path):
    """Issue 27, finding 7: with a trial running (held after its final report), every listening socket of the driver
    and of each process it started (GCS, raylet, agents, workers) is on a loopback address; SIGTERM stops them all.
    Ray 2.60 alone listens on `::` and on the machine's address."""
    experiment = write_experiment(tmp_path, "loopback", search={"algorithm": "grid", "max_concurrent": 1})
    markers = tmp_path / "paused"
    markers.mkdir()
    started = time.time()
    log_path = tmp_path / "sweep.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(sweep_command(experiment), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env=env(TAYLOR_TUNE_TEST_PAUSE=str(markers)))
    try:
        assert wait_for(lambda: any(markers.iterdir()), timeout=300), log_path.read_text()[-2000:]
        driver = psutil.Process(proc.pid)
        family = [driver, *driver.children(recursive=True)]
        listening = {}
        for p in family:
            try:
                sockets = p.net_connections(kind="inet")
            except psutil.NoSuchProcess:
                continue
            for s in sockets:
                if s.status == psutil.CONN_LISTEN:
                    listening[(s.laddr.ip, s.laddr.port)] = p.cmdline()[0][-40:]
        names = " ".join(listening.values())
        assert "gcs_server" in names and "raylet" in names and "ray::" in names, listening  # the test sees Ray
        assert {ip for ip, _ in listening} <= LOOPBACK, listening

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 4  # stopped with the grid not done
        assert wait_for(lambda: not any(_alive(p) for p in family), timeout=60), [p.pid for p in family if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
        kill_ray_started_after(started)
