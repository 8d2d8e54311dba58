"""Searches other than the grid, end to end: TPE with ASHA (one study per model), several objectives, a sweep for the
lowest perplexity."""

import json
import math
import os
import subprocess

import pandas as pd
import pytest

from taylor_tune.reporting import build_report, load_trials
from taylor_tune.reporting.status import sweep_status
from tests.sweep_helpers import (
    SMALL,
    analysis_rows,
    env,
    run_sweep_to_end,
    sweep_command,
    write_experiment,
)

pytestmark = pytest.mark.slow  # every test here runs Ray sweeps


def test_tpe_with_asha_runs_one_study_per_model(tmp_path, ray_head):
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
    run_sweep_to_end(experiment, cluster=ray_head)
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


def test_a_multi_objective_tpe_sweep_searches_any_setting_and_reports_the_front(tmp_path, ray_head):
    import pickle

    from tests.reporting.test_pareto import brute_force

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
    proc = run_sweep_to_end(experiment, cluster=ray_head)
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
    # every trial scored the same items, so every domination's lead is judged paired on acc_mean (issue 64, build 4)
    dominations = sum(len(d) for d in dominators.values())
    text = (out / "final_analysis_report.txt").read_text()
    assert f"interleaved timing) for {dominations} domination(s)" in text
    assert "separated by the paired intervals only: " in text
    best = json.loads((out / "consolidated_tiny-llama" / "best_under_constraints.json").read_text())
    meeting = kept[kept["decode_speedup"] >= 0.5].sort_values(["acc_mean", "trial_id"], ascending=[False, True])
    assert best["best"]["point"] == meeting["trial_id"].iloc[0] and best["satisfying"] == len(meeting)
    assert (out / "figures" / "pareto_tiny-llama.png").is_file()
    refused = subprocess.run([*sweep_command(folder)[:3], "report", str(folder), "--output", str(out),
                              "--constraint", "speed>=1"], capture_output=True, text=True, env=env())
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "'speed' is not a column" in refused.stderr


def test_a_sweep_for_the_lowest_perplexity_is_ranked_by_it_in_tune_status_and_report(tmp_path, ray_head):
    experiment = write_experiment(tmp_path, "ppl", metric="ppl", mode="min",
                                  evaluation={**SMALL["evaluation"], "ppl": "world", "ppl_max_windows": 4})
    run_sweep_to_end(experiment, cluster=ray_head)
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
    # ties judged paired on the same 4 windows: every trial kept its windows, and the runner-up's lead is in log ppl
    lead = report.models["tiny-llama"].lead
    assert (lead.paired, lead.unit) == (5, "log ppl") and len(report.table.ppl_windows) == 6
    runner = next(r for r in rows if r["trial_id"] == lead.runner_up)
    assert lead.difference == pytest.approx(math.log(runner["ppl"] / lowest["ppl"]), rel=1e-9)
    from taylor_tune.reporting.render import render_text

    text = render_text(report)
    assert f"Lead over the runner-up {lead.runner_up}: {lead.difference:+.4f} log ppl ± {lead.stderr:.4f}" in text
    assert "Ties judged paired on the same perplexity windows for 5 trial(s)" in text
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


def test_metric_tags_reach_ray_in_ascii_whatever_the_model_path_holds():
    """Issue 62, finding 6: Ray's metrics take ASCII tags only (its own record raises UnicodeEncodeError, with or
    without a cluster); a model folder named /data/modèle reaches them escaped, each value still distinct."""
    from taylor_tune.sweep.tune.metrics import SweepMetricsCallback, TrialMetrics, tags

    trial = TrialMetrics("expérience", "/data/modèle", "t_0")
    trial.observe({"stage": "load", "load_seconds": 1.0, "importance_cache": "hit", "peak_gpu_memory_bytes": 5})
    callback = SweepMetricsCallback("expérience", "zero_shot_all", flush_s=0)
    callback.on_trial_result(0, [], None, {"model": "/data/modèle", "stage": "zero_shot_all", "acc_mean": 0.5})
    assert tags(model="/data/modèle") == {"model": "/data/mod\\xe8le"}
    assert tags(model="/data/modèle") != tags(model="/data/modele") and tags(a="plain") == {"a": "plain"}


@pytest.mark.slow
def test_a_sweep_of_a_model_in_a_folder_with_a_non_ascii_name_finishes(tmp_path, ray_head):
    """The same through the CLI, where a user meets it: one trial of tiny-llama saved under a non-ASCII folder."""
    from taylor_tune.sources.models import load_model, load_tokenizer

    folder = tmp_path / "modèle"
    load_model("tiny-llama").save_pretrained(folder)
    load_tokenizer("tiny-llama").save_pretrained(folder)
    experiment = write_experiment(
        tmp_path, "ascii", models=[str(folder)],
        search_space={"taylor_seq_len": {"grid": [16]}, "taylor_num_samples": {"grid": [8]},
                      "pruning_method": {"grid": ["taylor"]}},
        evaluation={**SMALL["evaluation"], "speed": None},
    )
    proc = run_sweep_to_end(experiment, cluster=ray_head)
    assert "1 finished, 0 errored" in proc.stdout, proc.stdout[-2000:]
