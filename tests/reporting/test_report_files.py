"""The report's text, Markdown, LaTeX, figures and files, on synthetic trials with known answers."""

import json
import math
import re
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

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
    TASKS,
    by_hand,
    latex_rows,
    write_tune_folder,
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
    assert "Recovery: before and after" not in text  # no recovery columns: no recovery section


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

@pytest.mark.slow  # a whole report with its figures: seconds
def test_speed_vs_quality_table_and_figure_hold_each_trials_numbers(table, tmp_path):
    """Issue 28: with measured speed in the trials, the report's table per model holds every valid trial's speedups
    beside its quality (fastest decode first) and the figure's data the same points per method."""
    rng = np.random.default_rng(3)
    # each trial's layout drawn first, then written as the settings that make it (servable with align 512 is
    # servable; an aligned trial was once drawn as "free")
    drawn = rng.choice(["free", "uniform", "align 64", "align 128", "servable", "servable 512"], len(table))
    timed = table.assign(
        decode_speedup=rng.uniform(0.9, 1.6, len(table)),
        prefill_speedup=rng.uniform(1, 2, len(table)),
        decode_batch_speedup=rng.uniform(1, 2, len(table)),
        memory_ratio=rng.uniform(0.5, 1, len(table)),
        uniform=drawn == "uniform",
        servable=np.char.startswith(drawn.astype(str), "servable"),
        align=[float(k.split()[1]) if " " in k else np.nan for k in drawn],
    )
    timed["layout"] = ["depth" if m == "depth" else k.split()[0] if k.startswith("servable") else k
                       for m, k in zip(timed["pruning_method"], drawn)]
    assert {"free", "uniform", "align 64", "servable"} <= set(timed["layout"])
    report = build_report(timed.drop(columns="layout"))
    for name, m in report.models.items():
        rows = timed[timed["model"] == name]
        assert len(m.speed) == len(rows)
        assert list(m.speed["decode_speedup"]) == sorted(rows["decode_speedup"], reverse=True)
        by_id = rows.set_index("trial_id")
        for _, row in m.speed.iterrows():
            for column in ("acc_mean", "prefill_speedup", "memory_ratio", "pruning_method", "layout"):
                assert row[column] == by_id.loc[row["trial_id"], column]
        data = plots.speed_quality_data(m.speed, name)
        for k, method in enumerate(data.methods):
            mine = rows[rows["pruning_method"] == method]
            assert sorted(data.speedup[k]) == sorted(mine["decode_speedup"])
            assert sorted(zip(data.speedup[k], data.acc_mean[k], data.labels[k])) == sorted(
                zip(mine["decode_speedup"], mine["acc_mean"], mine["layout"])
            )
    assert "9. Speed vs quality" in render_text(report)
    written = write_report(report, tmp_path / "r")
    for name in report.models:
        assert tmp_path / "r" / f"consolidated_{name}" / "speed_quality.csv" in written
        assert (tmp_path / "r" / "figures" / f"speed_quality_{name}.png").stat().st_size > 0
    assert build_report(table).models["model-a"].speed is None  # no trial measured: no section, no figure
    assert "Speed vs quality" not in render_text(build_report(table))
