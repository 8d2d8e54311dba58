"""Reporting on synthetic trial tables with known answers: every statistic against an independent computation."""

import json
import math
import re
import shutil
import statistics
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from scipy import stats as scipy_stats

from taylor_tune.errors import ReportError
from taylor_tune.reporting import (
    build_report,
    latex,
    load_trials,
    plots,
    render_markdown,
    render_text,
    stats,
    write_report,
)
from tests.report_helpers import (
    EFFECTS,
    METHODS,
    SAMPLES,
    SEQ_LENS,
    TASKS,
    latex_rows,
    synthetic_trials,
    write_tune_folder,
)


@pytest.fixture(scope="module")
def table():
    return synthetic_trials()


@pytest.fixture(scope="module")
def report(table):
    return build_report(table)


def by_hand(df, key, value="acc_mean"):
    """{group: (mean, stdev, min, max, n)} with the statistics module: no pandas."""
    groups = {}
    for k, v in zip(df[key], df[value]):
        groups.setdefault(k, []).append(v)
    return {k: (statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else float("nan"), min(v), max(v), len(v))
            for k, v in groups.items()}


def pearson_by_hand(x, y):
    x, y = np.asarray(x, float), np.asarray(y, float)
    r = float(np.corrcoef(x, y)[0, 1])
    t = r * math.sqrt((len(x) - 2) / (1 - r * r))
    return r, float(2 * scipy_stats.t.sf(abs(t), len(x) - 2))


def test_the_best_configuration_method_and_hyperparameters_are_the_built_in_ones(report):
    for model, effects in EFFECTS.items():
        m = report.models[model]
        assert (m.best["pruning_method"], m.best["taylor_seq_len"], m.best["taylor_num_samples"]) == effects["best"]
        assert m.methods["best_method"] == effects["best"][0]
        assert m.methods["best_method_by_mean"] == max(effects["method"], key=effects["method"].get)
        assert m.seq_len["best_value"] == max(effects["seq_len"], key=effects["seq_len"].get)
        assert m.num_samples["best_value"] == max(effects["samples"], key=effects["samples"].get)
    assert report.overall_best["model"] == max(EFFECTS, key=lambda m: report.models[m].best["acc_mean"])


@pytest.mark.parametrize("key", ["pruning_method", "taylor_seq_len", "taylor_num_samples"])
def test_grouped_statistics_equal_the_statistics_module(report, table, key):
    for model, m in report.models.items():
        expected = by_hand(table[table["model"] == model], key)
        got = {"pruning_method": m.methods, "taylor_seq_len": m.seq_len, "taylor_num_samples": m.num_samples}[key][
            "table"
        ]
        assert set(got.index) == set(expected)
        for value, (mean, std, low, high, n) in expected.items():
            row = got.loc[value]
            assert row["mean"] == pytest.approx(mean, abs=1e-12) and row["std"] == pytest.approx(std, abs=1e-12)
            assert (row["min"], row["max"], row["count"]) == (low, high, n)


def test_correlations_equal_numpy_and_the_t_test_and_say_why_when_undefined(report, table):
    for model, m in report.models.items():
        rows = table[table["model"] == model]
        for c in m.gradient + [m.ppl, m.extreme["correlation"]]:
            if c.x == "grad_mean_range":  # constant by construction
                assert c.r is None and "constant" in c.reason and "undefined" in c.describe()
                continue
            r, p = pearson_by_hand(rows[c.x], rows["acc_mean"])
            assert c.r == pytest.approx(r, abs=1e-12) and c.p == pytest.approx(p, rel=1e-6) and c.n == len(rows)
        assert m.ppl.strength == "strong negative"  # ppl was built as 30 - 20 * acc
        assert report.models[model].gradient[0].strength == "strong positive"


def test_correlation_leaves_out_inf_and_missing_rows_and_counts_them():
    df = pd.DataFrame(
        {"x": [1.0, 2.0, 3.0, 4.0, math.inf, None, 7.0], "acc_mean": [0.1, 0.25, 0.2, 0.4, 0.5, 0.6, 0.65]}
    )
    c = stats.correlation(df, "x")
    keep = [0, 1, 2, 3, 6]
    assert c.n == 5 and c.excluded == {"inf": 1, "missing": 1}
    assert c.r == pytest.approx(pearson_by_hand(df["x"][keep], df["acc_mean"][keep])[0])
    assert stats.correlation(df.iloc[:2], "x").reason.startswith("only 2 rows")
    assert stats.correlation(df, "absent").reason == "column absent is absent"


@pytest.mark.parametrize(
    "r, words",
    [
        (0.697, "moderate positive"),
        (-0.512, "moderate negative"),
        (-0.754, "strong negative"),
        (0.4659, "weak positive"),
        (-0.29, "negligible"),
        (0.7, "strong positive"),
    ],
)
def test_strength_words_follow_the_documented_thresholds(r, words):
    assert stats.strength(r) == words


def test_acc_mean_stderr_interval_and_ties_match_a_brute_force_loop(report, table):
    for model, m in report.models.items():
        rows = table[table["model"] == model].set_index("trial_id")
        se = {t: math.sqrt(sum(rows.loc[t, f"acc_{k}_stderr"] ** 2 for k in TASKS)) / len(TASKS) for t in rows.index}
        best = m.best["trial_id"]
        assert m.best_stderr == pytest.approx(se[best])
        tied = [
            t
            for t in rows.index
            if t != best
            and rows.loc[best, "acc_mean"] - rows.loc[t, "acc_mean"]
            <= stats.Z95 * math.sqrt(se[best] ** 2 + se[t] ** 2)
        ]
        assert sorted(m.lead.tied_with_best) == sorted(tied)
        runner = rows.drop(best)["acc_mean"].idxmax()
        assert m.lead.runner_up == runner
        assert m.lead.exceeds_uncertainty == (
            m.lead.difference > stats.Z95 * math.sqrt(se[best] ** 2 + se[runner] ** 2)
        )
        low, high = stats.confidence_interval(m.best["acc_mean"], se[best])
        assert low == pytest.approx(m.best["acc_mean"] - 1.959964 * se[best], abs=1e-6) and high <= 1.0


@pytest.mark.parametrize("correct, n", [(40, 40), (0, 40), (31, 40), (150, 200)])
def test_wilson_interval_equals_the_roots_of_its_quadratic_and_stays_honest_at_the_edges(correct, n):
    # the closed form of the Wilson score interval, written independently: p_hat, z^2 terms, quadratic roots
    z, p = 1.959963984540054, correct / n
    a, b, c = 1 + z * z / n, -(2 * p + z * z / n), p * p
    roots = sorted(((-b - math.sqrt(b * b - 4 * a * c)) / (2 * a), (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)))
    low, high = stats.wilson_interval(p, n)
    assert (low, high) == pytest.approx(tuple(roots), abs=1e-12)
    if correct == n:
        assert high == 1.0 and low < 0.95  # 40 of 40 is not certainty (the binomial stderr there is 0)


@pytest.mark.slow
def test_a_real_lead_and_a_tie_are_told_apart():
    df = synthetic_trials(n_items=100_000)  # tiny stderrs: the built-in 0.03 bonus is far beyond them
    lead = build_report(df).models["model-a"].lead
    assert lead.exceeds_uncertainty and lead.tied_with_best == []
    noisy = build_report(synthetic_trials(n_items=20)).models["model-a"].lead  # 20 items per task: stderr ~ 0.04
    assert (
        not noisy.exceeds_uncertainty
        and len(noisy.tied_with_best) > (len(METHODS) * len(SEQ_LENS) * len(SAMPLES) - 1) / 2
    )


@pytest.mark.slow
def test_seed_spread_with_repeats_equals_statistics_stdev():
    df = synthetic_trials(seeds=(0, 1, 2), noise=0.01)
    m = build_report(df).models["model-b"]
    rows = df[
        (df["model"] == "model-b")
        & (df["pruning_method"] == "taylor")
        & (df["taylor_seq_len"] == 32)
        & (df["taylor_num_samples"] == 256)
    ]
    assert m.seeds["table"].loc[("taylor", 32, 256), "std"] == pytest.approx(statistics.stdev(rows["acc_mean"]))
    assert m.seeds["table"]["count"].eq(3).all()
    assert "one calibration seed" in build_report(synthetic_trials()).models["model-b"].seeds["reason"]


@pytest.mark.slow
def test_heldout_selection_chooses_on_one_half_and_reports_the_other(report, table):
    for model, m in report.models.items():
        rows = table[table["model"] == model]
        sel = {t: statistics.fmean(r[f"acc_{k}_sel"] for k in TASKS) for t, r in rows.set_index("trial_id").iterrows()}
        chosen = max(sel, key=sel.get)
        held = statistics.fmean(rows.set_index("trial_id").loc[chosen, [f"acc_{k}_heldout" for k in TASKS]])
        assert m.heldout["chosen"] == chosen and m.heldout["heldout_acc"] == pytest.approx(held)
    assert "did not record" in build_report(table.drop(columns=["acc_piqa_sel"])).models["model-a"].heldout["reason"]


def test_fanova_puts_the_importance_on_the_only_parameter_that_matters():
    df = synthetic_trials(noise=0.0)
    df["acc_mean"] = df["pruning_method"].map({"taylor": 0.5, "layerwise": 0.6, "blockwise": 0.7})
    result = stats.hyperparameter_importance(df[df["model"] == "model-a"])
    assert result["importances"]["pruning_method"] > 0.95
    assert sum(result["importances"].values()) == pytest.approx(1.0)
    flat = df[df["model"] == "model-a"].assign(acc_mean=1.0)  # seen on a real sweep: every trial scored 1.0
    assert "no variance" in stats.hyperparameter_importance(flat)["reason"]


def test_value_of_search_equals_a_lookup_by_hand(report, table):
    vos = report.value_of_search.set_index(["config_of", "applied_to"])
    for source, target in [("model-a", "model-b"), ("model-b", "model-a"), ("model-a", "model-a")]:
        method, seq_len, samples = report.models[source].best[
            ["pruning_method", "taylor_seq_len", "taylor_num_samples"]
        ]
        rows = table[table["model"] == target]
        acc = rows[
            (rows["pruning_method"] == method)
            & (rows["taylor_seq_len"] == seq_len)
            & (rows["taylor_num_samples"] == samples)
        ]["acc_mean"].mean()
        assert vos.loc[(source, target), "loss"] == pytest.approx(rows["acc_mean"].max() - acc)
    assert vos.loc[("model-a", "model-a"), "loss"] == 0


def test_plot_data_objects_hold_the_means_by_hand(report, table):
    heat = plots.heatmap_data(report.table.valid, "model-a")
    rows = table[table["model"] == "model-a"]
    for i, s in enumerate(SEQ_LENS):
        for j, n in enumerate(SAMPLES):
            cell = rows[(rows["taylor_seq_len"] == s) & (rows["taylor_num_samples"] == n)]["acc_mean"]
            assert heat.values[i][j] == pytest.approx(statistics.fmean(cell)) and heat.counts[i][j] == len(METHODS)
    bars = plots.method_bars(report.table.valid)
    for k, method in enumerate(bars.methods):
        for j, model in enumerate(bars.models):
            accs = table[(table["model"] == model) & (table["pruning_method"] == method)]["acc_mean"]
            assert bars.means[k][j] == pytest.approx(statistics.fmean(accs)) and bars.stds[k][j] == pytest.approx(
                statistics.stdev(accs)
            )


def tabular_rows_are_well_formed(tex: str) -> None:
    """Without a TeX engine: every tabular row has as many cells as its column spec, braces balance."""
    assert tex.count("{") == tex.count("}") and r"\toprule" in tex and r"\bottomrule" in tex
    for block in tex.split(r"\begin{tabular}{")[1:]:
        spec, body = block.split("}", 1)
        body = body.split(r"\end{tabular}")[0]
        for line in body.splitlines():
            line = line.strip()
            if not line.endswith(r"\\"):
                continue
            spans = sum(int(n) - 1 for n in re.findall(r"\\multicolumn\{(\d+)\}", line))
            assert len(re.findall(r"(?<!\\)&", line)) + 1 + spans == len(spec), (spec, line)


def test_latex_method_and_seq_len_tables_hold_the_statistics_module_s_numbers(report, table):
    """Ranked by acc_mean: the paper's columns (mean, std, best), the highest mean in bold."""
    for model, m in report.models.items():
        rows = table[table["model"] == model]
        expected = by_hand(rows, "pruning_method")
        tex = latex.method_table({model: m.methods["table"]})
        assert r"\textbf{Mean ACC} & \textbf{Std} & \textbf{Best ACC}" in tex
        top = max(expected, key=lambda k: expected[k][0])
        for cells in latex_rows(tex):
            method = cells[1][0].lower()
            mean, std, _, high, _ = expected[method]
            assert [c[0] for c in cells[2:]] == [f"{mean:.4f}", f"{std:.3f}", f"{high:.4f}"]
            assert [c[1] for c in cells[2:]] == [method == top, False, False]
        by_seq = by_hand(rows, "taylor_seq_len")
        (cells,) = latex_rows(latex.seq_len_table({model: m.seq_len["table"]}))
        assert [c[0] for c in cells[1:-1]] == [f"{by_seq[s][0]:.3f}" for s in sorted(by_seq)]
        best = max(by_seq, key=lambda s: by_seq[s][0])
        assert [c[1] for c in cells[1:-1]] == [s == best for s in sorted(by_seq)]
        assert cells[-1][0] == f"peak at {best}"


@pytest.mark.slow
def test_latex_tables_are_well_formed_and_compile_where_tex_is_installed(report, tmp_path):
    write_report(report, tmp_path)
    tex = (tmp_path / "paper" / "tables.tex").read_text()
    tabular_rows_are_well_formed(tex)
    assert "blockwise".capitalize() in (tmp_path / "paper" / "table1_best_configs.tex").read_text()
    assert latex.trend([0.5, 0.6, 0.7]) == "monotonic increase" and latex.escape("a_b&c") == r"a\_b\&c"
    if shutil.which("pdflatex") is None:
        pytest.skip("no pdflatex: checked structurally only")
    proc = subprocess.run(
        ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "tables.tex"],
        cwd=tmp_path / "paper",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert (tmp_path / "paper" / "tables.pdf").stat().st_size > 1000


def test_text_and_markdown_name_every_section_in_english(report):
    text, markdown = render_text(report), render_markdown(report)
    for title in (
        "1. Pruning methods",
        "2. Hyperparameters",
        "3. Gradient statistics",
        "4. Extreme-pruning layers",
        "5. Perplexity vs acc_mean",
        "6. Best configuration",
        "7. Calibration-seed spread",
        "8. Held-out selection",
        "Cross-model comparison",
        "Value of the search",
        "Statistically tied with the best",
    ):
        assert title in text and title in markdown
    assert "nan" not in text.lower().replace("nan-", "")


@pytest.mark.slow
def test_per_task_intervals_use_the_item_count_when_trials_record_it(table):
    rows = table.assign(**{f"acc_{t}_n": 40 for t in TASKS})
    rows.loc[:, "acc_piqa"] = 1.0
    rows.loc[:, "acc_piqa_stderr"] = 0.0
    text = render_text(build_report(rows))
    low, _ = stats.wilson_interval(1.0, 40)
    assert f"{low:.4f}" in text  # piqa at 40/40: a real lower bound, not [1, 1]


# ---------------------------------------------------------------- robustness on Tune-format folders


def test_a_tune_folder_reads_back_the_same_table(tmp_path, table):
    path = write_tune_folder(table, tmp_path / "exp")
    loaded = load_trials(path)
    assert loaded.valid.shape[0] == len(table) and loaded.invalid.empty
    got = loaded.valid.set_index(["model", "pruning_method", "taylor_seq_len", "taylor_num_samples"])[
        "acc_mean"
    ].sort_index()
    want = table.set_index(["model", "pruning_method", "taylor_seq_len", "taylor_num_samples"])["acc_mean"].sort_index()
    pd.testing.assert_series_equal(got, want, check_names=False)
    assert load_trials(f"file://{path}").valid.shape[0] == len(table)  # the URI path that s3:// takes too


def test_a_trial_that_ran_again_after_a_resume_counts_once(tmp_path, table):
    path = write_tune_folder(table.head(3), tmp_path / "exp")
    first = sorted(path.iterdir())[1]  # its first run was killed after the pruning report: a partial result.json
    orphan = path / first.name.replace("2026-11-21_00-00-00", "2026-11-20_23-59-59")
    orphan.mkdir()
    (orphan / "params.json").write_text((first / "params.json").read_text())
    (orphan / "result.json").write_text((first / "result.json").read_text().splitlines()[0] + "\n")
    report = build_report(path)
    assert len(report.table.trials) == 3 and report.table.invalid.empty and report.table.superseded == 1
    assert "1 folder(s) of trials that ran again" in render_text(report)


def test_broken_trials_are_counted_with_their_reasons_and_the_report_still_builds(tmp_path, table):
    rows = table[table["model"] == "model-a"].head(8).copy()
    path = write_tune_folder(rows, tmp_path / "exp")
    trials = sorted(path.iterdir())
    text = (trials[0] / "result.json").read_text()
    (trials[0] / "result.json").write_text(
        text[: len(text) - 40]
    )  # truncated last line: only the "pruned" report is left
    (trials[1] / "result.json").write_text('{"acc_mean": ')  # nothing readable
    for trial, value in ((trials[2], "NaN"), (trials[3], "Infinity")):
        lines = (trial / "result.json").read_text().splitlines()
        final = json.loads(lines[-1])
        lines[-1] = json.dumps(final).replace(f'"acc_mean": {final["acc_mean"]}', f'"acc_mean": {value}')
        (trial / "result.json").write_text("\n".join(lines) + "\n")
    (trials[4] / "result.json").unlink()
    (trials[4] / "error.txt").write_text(
        "Failure # 1 (occurred at 2026-11-21)\nTraceback ...\nRuntimeError: CUDA out of memory\n"
    )
    lines = (trials[5] / "result.json").read_text().splitlines()
    final = json.loads(lines[-1])
    del final["acc_piqa"]
    (trials[5] / "result.json").write_text(lines[0] + "\n" + json.dumps(final) + "\n")

    report = build_report(path)
    reasons = dict(zip(report.table.invalid["trial_id"], report.table.invalid["reason"]))
    assert len(report.table.valid) == 2 and len(reasons) == 6
    assert reasons["abcde_00000"] == "incomplete: no finite acc_mean (last stage 'pruned')"
    assert reasons["abcde_00001"] == "result.json has no readable report"
    assert "no finite acc_mean" in reasons["abcde_00002"] and "no finite acc_mean" in reasons["abcde_00003"]
    assert reasons["abcde_00004"] == "errored: RuntimeError: CUDA out of memory"
    assert reasons["abcde_00005"] == "acc_piqa is missing or not finite"
    files = write_report(report, tmp_path / "out")
    text = (tmp_path / "out" / "final_analysis_report.txt").read_text()
    assert "Trials: 8, valid: 2, invalid: 6" in text and "CUDA out of memory" in text
    assert "undefined: only 2 rows" in text  # two valid trials: correlations say why they are missing
    assert len(files) > 10


@pytest.mark.slow
def test_a_task_missing_from_every_trial_inf_gradients_one_trial_and_an_empty_folder(tmp_path, table):
    rows = table.drop(columns=["acc_piqa", "acc_piqa_stderr"]).copy()
    rows.loc[rows.index[:5], "grad_norm_ratio"] = math.inf
    report = build_report(rows)
    assert report.table.tasks == tuple(t for t in TASKS if t != "piqa") and report.table.invalid.empty
    assert report.models["model-a"].gradient[1].excluded["inf"] == 5
    write_report(report, tmp_path / "a")
    assert "PIQA" not in (tmp_path / "a" / "paper" / "table2_task_accuracy.tex").read_text()

    single = build_report(table.head(1))
    assert single.models["model-a"].lead.reason.startswith("only one valid trial")
    write_report(single, tmp_path / "b")
    assert (tmp_path / "b" / "best_model-a" / "MISSING.txt").is_file()  # a DataFrame has no trial folders to copy

    (tmp_path / "empty").mkdir()  # a sweep that started and has no trial yet: its state file, no trial folder
    (tmp_path / "empty" / "experiment_state-2026-01-01_00-00-00.json").write_text('{"trial_data": []}')
    empty = build_report(tmp_path / "empty")
    write_report(empty, tmp_path / "c")
    assert "No valid trials among 0" in (tmp_path / "c" / "final_analysis_report.txt").read_text()


@pytest.mark.slow
def test_report_cli_writes_every_file_and_rejects_bad_input(tmp_path, table):
    path = write_tune_folder(table, tmp_path / "exp")
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "taylor_tune", "report", str(path), "--output", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "90 trials (90 valid, 0 invalid)" in proc.stdout
    for name in ("model-a", "model-b"):
        for f in (
            f"consolidated_{name}/all_methods_results.csv",
            f"consolidated_{name}/global_best_config.json",
            f"consolidated_{name}/method_comparison.json",
            f"figures/heatmap_{name}.png",
            f"best_{name}/best_config.json",
            f"best_{name}/visualization/gradient_analysis.png",
            f"best_{name}/visualization/pruning_ratio.png",
            f"best_{name}/visualization/retention_ratio.png",
            f"best_{name}/analysis/pruning_comparison.json",
        ):
            assert (out / f).is_file(), f
    for f in (
        "cross_model_comparison.json",
        "final_analysis_report.txt",
        "final_analysis_report.md",
        "figures/methods_by_models.png",
        "paper/table1_best_configs.tex",
        "paper/table2_task_accuracy.tex",
        "paper/table3_method_comparison.tex",
        "paper/table4_seq_len.tex",
        "invalid_trials.csv",
    ):
        assert (out / f).is_file(), f
    best = json.loads((out / "consolidated_model-a" / "global_best_config.json").read_text())
    assert (
        tuple(best["config"][k] for k in ("pruning_method", "taylor_seq_len", "taylor_num_samples"))
        == EFFECTS["model-a"]["best"]
    )
    csv = pd.read_csv(out / "consolidated_model-b" / "all_methods_results.csv")
    assert len(csv) == 45 and csv["acc_mean"].is_monotonic_decreasing
    for args, words in (
        (["/no/such/folder"], "no such experiment folder"),
        ([str(path), "--model", "model-z"], "--model 'model-z'"),
        ([str(path), "--z", "-1"], "--z: must be > 0"),
    ):
        bad = subprocess.run([sys.executable, "-m", "taylor_tune", "report", *args, "--output", str(tmp_path / "x")],
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and words in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_reporting_imports_neither_torch_nor_ray():
    code = (
        "import sys, taylor_tune.reporting, taylor_tune.reporting.report, taylor_tune.reporting.plots, "
        "taylor_tune.reporting.latex; "
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"


# ---------------------------------------------------------------- a sweep that optimized perplexity (metric: ppl,
# mode: min)

PPL_BEST = {"model-a": ("taylor", 32, 256), "model-b": ("blockwise", 256, 128)}


@pytest.fixture(scope="module")
def ppl_table():
    """The synthetic trials with a perplexity landscape of its own: its best cell is not the accuracy's best."""
    rows = synthetic_trials()
    rng = np.random.default_rng(1)
    ppl = np.exp(rng.uniform(3.0, 4.5, len(rows)))  # 20 ... 90, spread as perplexities are
    for model, (method, seq_len, samples) in PPL_BEST.items():
        ppl[((rows["model"] == model) & (rows["pruning_method"] == method) & (rows["taylor_seq_len"] == seq_len)
             & (rows["taylor_num_samples"] == samples)).to_numpy()] = 12.0 if model == "model-a" else 15.0
    return rows.assign(ppl=ppl)


@pytest.fixture(scope="module")
def ppl_report(ppl_table, tmp_path_factory):
    folder = write_tune_folder(
        ppl_table, tmp_path_factory.mktemp("ppl") / "exp", objective={"metric": "ppl", "mode": "min"}
    )
    return build_report(str(folder))


def test_a_ppl_sweep_is_ranked_by_its_lowest_perplexity_as_pandas_recomputes_it(ppl_report, ppl_table):
    assert ppl_report.objective == stats.Objective("ppl", "min")
    for model, m in ppl_report.models.items():
        rows = ppl_table[ppl_table["model"] == model]
        lowest = rows.loc[rows["ppl"].idxmin()]
        assert tuple(m.best[["pruning_method", "taylor_seq_len", "taylor_num_samples"]]) == PPL_BEST[model]
        assert m.best["ppl"] == pytest.approx(lowest["ppl"])
        for key, impact in (
            ("pruning_method", None),
            ("taylor_seq_len", m.seq_len),
            ("taylor_num_samples", m.num_samples),
        ):
            expected = by_hand(rows, key, "ppl")
            table = m.methods["table"] if impact is None else impact["table"]
            for value, (mean, std, low, high, n) in expected.items():
                assert table.loc[value, "mean"] == pytest.approx(mean) and table.loc[value, "std"] == pytest.approx(std)
            gmeans = {k: math.exp(statistics.fmean(map(math.log, rows[rows[key] == k]["ppl"]))) for k in expected}
            assert table["gmean"].to_dict() == pytest.approx(gmeans)
            best_by_gmean = min(gmeans, key=gmeans.get)  # a perplexity's groups are ranked by their geometric mean
            assert (m.methods["best_method_by_mean"] if impact is None else impact["best_value"]) == best_by_gmean
        r, p = pearson_by_hand(rows["grad_mean_ratio"], rows["ppl"])
        assert m.gradient[0].y == "ppl" and m.gradient[0].r == pytest.approx(r) and m.gradient[0].p == pytest.approx(p)
        assert m.importance["of"] == "log(ppl)" and sum(m.importance["importances"].values()) == pytest.approx(1.0)
        assert m.lead.exceeds_uncertainty is None and "no standard error" in m.lead.reason
    assert ppl_report.cross["model"].tolist() == ["model-a", "model-b"]  # 12 before 15: lower is better
    vos = ppl_report.value_of_search.set_index(["config_of", "applied_to"])
    method, seq_len, samples = PPL_BEST["model-a"]
    rows = ppl_table[ppl_table["model"] == "model-b"]
    applied = rows[
        (rows["pruning_method"] == method)
        & (rows["taylor_seq_len"] == seq_len)
        & (rows["taylor_num_samples"] == samples)
    ]["ppl"].mean()
    assert vos.loc[("model-a", "model-b"), "loss"] == pytest.approx(applied - 15.0) and applied > 15.0
    text = render_text(ppl_report)
    assert "ranked by ppl (lower is better)" in text and "Gradient statistics vs ppl" in text


def test_a_ppl_sweeps_figures_and_csv_follow_its_metric(ppl_report, ppl_table, tmp_path):
    heat = plots.heatmap_data(ppl_report.table.valid, "model-a", "ppl")
    rows = ppl_table[ppl_table["model"] == "model-a"]
    assert heat.aggregate == "geometric mean"
    for i, s in enumerate(SEQ_LENS):
        for j, n in enumerate(SAMPLES):
            cell = rows[(rows["taylor_seq_len"] == s) & (rows["taylor_num_samples"] == n)]["ppl"]
            assert heat.values[i][j] == pytest.approx(scipy_stats.gmean(cell))
    bars = plots.method_bars(ppl_report.table.valid, "ppl")
    assert bars.metric == "ppl" and bars.aggregate == "geometric mean"
    for k, method in enumerate(bars.methods):
        logs = [math.log(v) for v in rows[rows["pruning_method"] == method]["ppl"]]
        assert bars.means[k][bars.models.index("model-a")] == pytest.approx(math.exp(statistics.fmean(logs)))
        assert bars.stds[k][bars.models.index("model-a")] == pytest.approx(math.exp(statistics.stdev(logs)))
    write_report(ppl_report, tmp_path / "out")
    csv = pd.read_csv(tmp_path / "out" / "consolidated_model-a" / "all_methods_results.csv")
    assert csv["ppl"].tolist() == sorted(rows["ppl"]) and csv["ppl"].iloc[0] == 12.0
    best = json.loads((tmp_path / "out" / "consolidated_model-a" / "global_best_config.json").read_text())
    assert best["objective"] == {"metric": "ppl", "mode": "min"} and best["config"]["pruning_method"] == "taylor"


def test_a_ppl_tie_goes_to_the_higher_accuracy_and_mixed_objectives_are_refused(ppl_table, tmp_path):
    rows = ppl_table[ppl_table["model"] == "model-a"].head(3).assign(ppl=20.0, acc_mean=[0.5, 0.7, 0.6])
    assert stats.best_trial(rows, stats.Objective("ppl", "min"))["acc_mean"] == 0.7
    mixed = write_tune_folder(ppl_table.head(4), tmp_path / "mixed", objective={"metric": "ppl", "mode": "min"})
    params = sorted(mixed.glob("*/params.json"))[-1]  # one trial of another sweep, copied in by hand
    config = json.loads(params.read_text())
    params.write_text(
        json.dumps(config | {"fixed": config["fixed"] | {"objective": {"metric": "acc_mean", "mode": "max"}}})
    )
    with pytest.raises(
        ReportError, match=r"different metrics \(.*(ppl \(min\).*acc_mean \(max\)|acc_mean \(max\).*ppl \(min\))"
    ):
        build_report(str(mixed))


@pytest.mark.parametrize("gap_in_se, exceeds", [(1.5, False), (2.5, True)])
def test_a_lead_counts_only_beyond_z_standard_errors(gap_in_se, exceeds):
    """Two trials, one task each with stderr 0.01: the gap's stderr is sqrt(2) x 0.01. A lead of 1.5 of them is
    within the 95% bound (z = 1.96) and the runner-up is tied; 2.5 of them is a real lead."""
    se = 0.01
    gap = gap_in_se * math.sqrt(2) * se
    df = pd.DataFrame({"trial_id": ["a", "b"], "acc_mean": [0.5 + gap, 0.5], "ppl": [10.0, 10.0],
                       "acc_piqa": [0.5 + gap, 0.5], "acc_piqa_stderr": [se, se]})
    lead = stats.lead_of_best(df, ("piqa",))
    assert (lead.best, lead.runner_up) == ("a", "b")
    assert lead.difference == pytest.approx(gap) and lead.stderr == pytest.approx(math.sqrt(2) * se)
    assert lead.exceeds_uncertainty is exceeds
    assert lead.tied_with_best == ([] if exceeds else ["b"])


def test_speed_vs_quality_table_and_figure_hold_each_trials_numbers(table, tmp_path):
    """Issue 28: with measured speed in the trials, the report's table per model holds every valid trial's speedups
    beside its quality (fastest decode first) and the figure's data the same points per method."""
    rng = np.random.default_rng(3)
    timed = table.assign(
        decode_speedup=rng.uniform(0.9, 1.6, len(table)),
        prefill_speedup=rng.uniform(1, 2, len(table)),
        decode_batch_speedup=rng.uniform(1, 2, len(table)),
        memory_ratio=rng.uniform(0.5, 1, len(table)),
        uniform=rng.random(len(table)) < 0.5,
    )
    report = build_report(timed)
    for name, m in report.models.items():
        rows = timed[timed["model"] == name]
        assert len(m.speed) == len(rows)
        assert list(m.speed["decode_speedup"]) == sorted(rows["decode_speedup"], reverse=True)
        by_id = rows.set_index("trial_id")
        for _, row in m.speed.iterrows():
            for column in ("acc_mean", "prefill_speedup", "memory_ratio", "pruning_method", "uniform"):
                assert row[column] == by_id.loc[row["trial_id"], column]
        data = plots.speed_quality_data(m.speed, name)
        for k, method in enumerate(data.methods):
            mine = rows[rows["pruning_method"] == method]
            assert sorted(data.speedup[k]) == sorted(mine["decode_speedup"])
            assert sorted(data.labels[k]) == sorted("uniform" if u else "free" for u in mine["uniform"])
            assert sorted(zip(data.speedup[k], data.acc_mean[k])) == sorted(
                zip(mine["decode_speedup"], mine["acc_mean"])
            )
    assert "9. Speed vs quality" in render_text(report)
    written = write_report(report, tmp_path / "r")
    for name in report.models:
        assert tmp_path / "r" / f"consolidated_{name}" / "speed_quality.csv" in written
        assert (tmp_path / "r" / "figures" / f"speed_quality_{name}.png").stat().st_size > 0
    assert build_report(table).models["model-a"].speed is None  # no trial measured: no section, no figure
    assert "Speed vs quality" not in render_text(build_report(table))
