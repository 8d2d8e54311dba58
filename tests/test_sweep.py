"""The sweep service end to end: real local Ray, real Tune, the offline world's tiny models."""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from taylor_tune.reporting import build_report, load_trials
from tests.sweep_helpers import (REPO, analysis_rows, env, finished, kill_ray_started_after, run_sweep, sweep_command,
                                 terminated, trial_dirs, wait_for, write_experiment)

SPEC_COLUMNS = ["output_dir", "ppl", "acc_mean", *[f"acc_{t}" for t in ("boolq", "piqa", "hellaswag", "winogrande",
                "arc_easy", "arc_challenge", "openbookqa")], "params_count", "pruning_ratio", "grad_mean_ratio",
                "grad_norm_ratio", "grad_mean_range", "grad_norm_range", "extreme_pruning_layers", "pruning_method",
                "taylor_seq_len", "taylor_num_samples"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The shipped smoke experiment, submitted as a Ray job to a real head node on loopback (its own temp dir,
    token auth disabled for the test), into a temporary storage path; the cluster is stopped afterwards."""
    storage = tmp_path_factory.mktemp("smoke")
    port, dashboard = free_port(), free_port()
    temp = Path("/tmp") / f"tt-ray-{os.getpid()}"  # Ray's socket paths must stay short
    ray_env = {**env(), "RAY_AUTH_MODE": "disabled"}
    bin_dir = Path(os.sys.executable).parent
    started = time.time()
    try:
        subprocess.run([str(bin_dir / "ray"), "start", "--head", f"--port={port}", "--dashboard-host=127.0.0.1",
                        f"--dashboard-port={dashboard}", "--num-cpus=2", f"--temp-dir={temp}", "--disable-usage-stats"],
                       check=True, env=ray_env, capture_output=True, timeout=120)
        job = subprocess.run(
            [str(bin_dir / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{dashboard}", "--",
             str(bin_dir / "taylor-tune"), "sweep", str(REPO / "experiments" / "smoke.yaml"), "--storage", str(storage)],
            capture_output=True, text=True, env=ray_env, timeout=900, cwd=REPO,
        )
    finally:
        kill_ray_started_after(started)  # the head node's processes and everything they started, by PID
    assert wait_for(lambda: not [p for p in psutil.process_iter(["cmdline"]) if str(temp) in " ".join(p.info["cmdline"] or [])], 30)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert "succeeded" in job.stdout
    return storage / "smoke", job


def test_smoke_sweep_runs_end_to_end_under_ray_job_submit_and_analysis_has_every_column(smoke):
    path, job = smoke
    assert "36 finished, 0 errored" in job.stdout
    rows = analysis_rows(path)
    assert len(rows) == 36
    for row in rows:
        missing = [c for c in SPEC_COLUMNS if row.get(c) is None]
        assert not missing, missing
        assert 0.19 < row["pruning_ratio"] < 0.21 and row["stage"] == "zero_shot_40"
        assert Path(row["output_dir"]).parent == path and (Path(row["output_dir"]) / "pruning_summary.json").is_file()
        written = json.loads((Path(row["output_dir"]) / "config.json").read_text())["prune"]  # reused workers: own folder
        assert (written["method"], written["seq_len"], written["num_samples"]) == (
            row["pruning_method"], row["taylor_seq_len"], row["taylor_num_samples"])
    grid = {(r["model"], r["pruning_method"], r["taylor_seq_len"], r["taylor_num_samples"]) for r in rows}
    assert len(grid) == 36


def test_tensorboard_has_the_per_stage_metrics(smoke):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path, _ = smoke
    trial = next(path.glob("sweep_trainable_*"))
    tags = set()
    for events in trial.glob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"])
    for metric in ("pruning_ratio", "grad_norm_ratio", "ppl", "acc_mean", "acc_piqa"):
        assert f"ray/tune/{metric}" in tags, sorted(tags)


def test_importance_passes_equal_distinct_model_seq_len_seed(smoke):
    path, _ = smoke
    events = [json.loads(l) for l in (path / "importance_cache" / "events.jsonl").read_text().splitlines()]
    computed = [e for e in events if e["event"] == "computed"]
    distinct = {(r["model"], r["taylor_seq_len"], r["seed"]) for r in analysis_rows(path)}
    assert len(computed) == len(distinct) == 6  # 3 models x 2 seq_lens x 1 seed, shared by methods and sample counts
    assert sum(e["event"] == "hit" for e in events) == 36 - 6


def test_status_reports_counts_and_best_per_model(smoke):
    path, _ = smoke
    proc = subprocess.run([os.sys.executable, "-m", "taylor_tune", "status", str(path)], capture_output=True, text=True, env=env())
    assert proc.returncode == 0
    assert "finished 36, errored 0" in proc.stdout
    assert sum(line.startswith("best so far for tiny-") for line in proc.stdout.splitlines()) == 3


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_an_interrupted_sweep_resumes_without_rerunning_finished_trials(sig, tmp_path):
    # 12 trials one at a time: with reused workers a trial takes about a second, so the interruption (2 finished
    # + 2.5 s for the saved state) must leave most of the grid still to run
    space = {"taylor_seq_len": {"grid": [16, 32, 48]}, "taylor_num_samples": {"grid": [8, 16]},
             "pruning_method": {"grid": ["taylor", "blockwise"]}}
    experiment = write_experiment(tmp_path, "resume", search_space=space, search={"algorithm": "grid", "max_concurrent": 1})
    path = tmp_path / "sweeps" / "resume"
    started = time.time()
    log = open(tmp_path / "first-run.log", "w")  # a file, not a pipe: nobody reads a pipe while we wait
    proc = subprocess.Popen(sweep_command(experiment), stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=REPO)
    try:
        assert wait_for(lambda: len(finished(path)) >= 2, timeout=180), "two trials never finished"
        time.sleep(2.5)  # the experiment state is saved every second
        proc.send_signal(sig)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
        kill_ray_started_after(started)
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


def test_a_failing_trial_is_retried_then_errored_and_the_rest_finish(tmp_path):
    fault = {"pruning_method": "blockwise", "taylor_seq_len": 32}
    experiment = write_experiment(tmp_path, "faulty", test_fault=fault, max_failures=2)
    started = time.time()
    proc = run_sweep(experiment)
    kill_ray_started_after(started)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "5 finished, 1 errored" in proc.stdout
    path = tmp_path / "sweeps" / "faulty"
    (bad,) = [p for p in trial_dirs(path).values() if "pruning_method=blockwise" in p.name and "taylor_seq_len=32" in p.name]
    errors = (bad / "error.txt").read_text()  # Tune's own record: one entry per failed attempt
    assert errors.count("Failure # ") == 3 and errors.count("InjectedFault: injected fault") == 3  # first try + 2 retries
    assert len(finished(path)) == 5
    report = build_report(path)  # the errored trial is counted with its reason, never crashes the report
    (reason,) = report.table.invalid["reason"]
    assert reason.startswith("errored: ") and "InjectedFault: injected fault" in reason and len(report.table.valid) == 5


def test_tpe_with_asha_runs_one_study_per_model(tmp_path):
    experiment = write_experiment(
        tmp_path, "tpe", models=["tiny-llama", "tiny-qwen2"],
        search_space={"taylor_seq_len": {"choice": [16, 32, 48]}, "taylor_num_samples": {"choice": [8, 16]},
                      "pruning_method": {"choice": ["taylor", "layerwise", "blockwise"]}},
        search={"algorithm": "tpe", "num_trials": 3, "scheduler": "asha", "seed": 0},
        evaluation={"tasks": "arc_challenge,openbookqa", "task_data": "world", "ppl": None, "batch_size": 16, "fidelities": [5, 20]},
    )
    started = time.time()
    proc = run_sweep(experiment)
    kill_ray_started_after(started)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = analysis_rows(tmp_path / "sweeps" / "tpe")
    assert sorted(r["model"] for r in rows) == ["tiny-llama"] * 3 + ["tiny-qwen2"] * 3
    assert all(r["stage"] in ("zero_shot_5", "zero_shot_20") for r in rows)  # ASHA may stop after the cheap pass
    assert all(r["taylor_seq_len"] in (16, 32, 48) and r["taylor_num_samples"] in (8, 16) for r in rows)
    table = load_trials(tmp_path / "sweeps" / "tpe")  # trials ASHA stopped at the cheap fidelity are not comparable
    stopped = [r for r in rows if r["stage"] == "zero_shot_5"]
    assert len(table.invalid) == len(stopped) and all("stopped early by the scheduler" in r for r in table.invalid["reason"])


def test_report_on_the_smoke_sweep_writes_every_file_with_the_numbers_ray_reads(smoke, tmp_path):
    import pandas as pd

    from tests.test_reporting import tabular_rows_are_well_formed

    path, _ = smoke
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
            assert methods[method]["mean"] == pytest.approx(group["acc_mean"].mean()) and methods[method]["count"] == len(group)
        heat = json.loads((out / "figures" / f"heatmap_{model}.json").read_text())
        means = rows.groupby(["taylor_seq_len", "taylor_num_samples"])["acc_mean"].mean()
        for i, s in enumerate(heat["seq_lens"]):
            for j, n in enumerate(heat["num_samples"]):
                assert heat["values"][i][j] == pytest.approx(means[(s, n)])
        csv = pd.read_csv(out / f"consolidated_{model}" / "all_methods_results.csv")
        assert len(csv) == len(rows) and {"ppl", "acc_mean", "acc_piqa", "grad_norm_ratio", "output_dir"} <= set(csv.columns)
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
            assert bars["means"][k][j] == pytest.approx(df[(df["model"] == model) & (df["pruning_method"] == method)]["acc_mean"].mean())
    text = (out / "final_analysis_report.txt").read_text()
    assert "Perplexity vs acc_mean" in text and "Overall best:" in text and (out / "final_analysis_report.md").is_file()
    tex = (out / "paper" / "tables.tex").read_text()
    tabular_rows_are_well_formed(tex)
    if shutil.which("pdflatex"):
        latex = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "tables.tex"], cwd=out / "paper",
                               capture_output=True, text=True, timeout=120)
        assert latex.returncode == 0, latex.stdout[-2000:]


def test_the_example_notebook_runs_headless_on_the_smoke_sweep(smoke, tmp_path):
    import nbclient
    import nbformat

    path, _ = smoke
    notebook = nbformat.read(REPO / "dashboards" / "explore_experiment.ipynb", as_version=4)
    os.environ["TAYLOR_TUNE_EXPERIMENT"], os.environ["TAYLOR_TUNE_REPORT"] = str(path), str(tmp_path / "nb-report")
    try:
        nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    finally:
        del os.environ["TAYLOR_TUNE_EXPERIMENT"], os.environ["TAYLOR_TUNE_REPORT"]
    printed = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs)
    assert "36 trials in" in printed and printed.count("lead real:") == 3
    assert (tmp_path / "nb-report" / "final_analysis_report.txt").is_file()
