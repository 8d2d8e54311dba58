"""The report on the real grid (experiments/real_paper_grid.yaml: SmolLM2-135M at 20%, ranked by wiki perplexity),
from a copy of some of its trial folders as kept in bench/real_paper_grid: every number the report files hold equals
a pandas recomputation from the folders' result.json files, read here without taylor_tune."""

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats as scipy_stats

from taylor_tune.reporting import build_report, write_report
from tests.report_helpers import latex_rows

REAL_GRID = Path(__file__).resolve().parents[2] / "bench" / "real_paper_grid"
KEEP = {"seq_len": (16, 64), "samples": (128, 512)}  # 2 x 2 x 3 methods = 12 of the 45 trials


def final_report(folder: Path) -> dict:
    lines = [line for line in (folder / "result.json").read_text().splitlines() if line.strip()]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def copied(tmp_path_factory):
    if not REAL_GRID.is_dir():
        pytest.fail(f"{REAL_GRID} is missing: the real grid's export is part of the repository")
    target = tmp_path_factory.mktemp("grid") / "real_paper_grid"
    for folder in sorted(REAL_GRID.iterdir()):
        final = final_report(folder) if (folder / "result.json").is_file() else {}
        if final.get("taylor_seq_len") in KEEP["seq_len"] and final.get("taylor_num_samples") in KEEP["samples"]:
            shutil.copytree(folder, target / folder.name)
    rows = pd.DataFrame([final_report(f) for f in sorted(target.iterdir())])
    assert len(rows) == 12 and rows["pruning_method"].nunique() == 3
    return target, rows


@pytest.fixture(scope="module")
def written(copied, tmp_path_factory):
    target, _ = copied
    out = tmp_path_factory.mktemp("report")
    report = build_report(str(target))
    write_report(report, out)
    return report, out


def test_the_real_grid_report_is_ranked_by_perplexity_and_its_best_is_the_lowest(copied, written):
    _, rows = copied
    report, out = written
    assert (report.objective.metric, report.objective.mode) == ("ppl", "min")
    best = rows.loc[rows["ppl"].idxmin()]
    written_best = json.loads((out / "consolidated_smollm2-135m" / "global_best_config.json").read_text())
    assert written_best["metrics"]["ppl"] == pytest.approx(best["ppl"])
    # the configuration: the model, every search dimension the trials report (these older ones: the paper's three and
    # the sparsity), the seed
    assert written_best["config"] == {
        k: best[k] for k in ("model", "pruning_method", "taylor_seq_len", "taylor_num_samples", "sparsity", "seed")
    }
    cross = json.loads((out / "cross_model_comparison.json").read_text())
    assert (
        cross["overall_best"]["best_ppl"] == pytest.approx(best["ppl"]) and cross["overall_best"]["valid_trials"] == 12
    )
    assert cross["key_figures"]["ppl_median"] == pytest.approx(rows["ppl"].median())
    csv = pd.read_csv(out / "consolidated_smollm2-135m" / "all_methods_results.csv")
    assert csv["ppl"].tolist() == pytest.approx(sorted(rows["ppl"]))


def test_the_real_grid_method_and_hyperparameter_tables_equal_pandas(copied, written):
    _, rows = copied
    _, out = written
    comparison = json.loads((out / "consolidated_smollm2-135m" / "method_comparison.json").read_text())
    for method, group in rows.groupby("pruning_method"):
        entry = comparison["methods"][method]
        assert entry["mean"] == pytest.approx(group["ppl"].mean()) and entry["std"] == pytest.approx(group["ppl"].std())
        assert entry["min"] == pytest.approx(group["ppl"].min()) and entry["count"] == len(group)
    gmean = lambda values: float(np.exp(np.log(values).mean()))  # noqa: E731
    assert comparison["best_method_by_mean"] == rows.groupby("pruning_method")["ppl"].apply(gmean).idxmin()
    for key, name in (("seq_len", "taylor_seq_len"), ("num_samples", "taylor_num_samples")):
        means, gmeans = rows.groupby(name)["ppl"].mean(), rows.groupby(name)["ppl"].apply(gmean)
        assert comparison[key]["best_value"] == gmeans.idxmin()
        assert {r[name]: r["mean"] for r in comparison[key]["table"]} == pytest.approx(means.to_dict())
        assert {r[name]: r["gmean"] for r in comparison[key]["table"]} == pytest.approx(gmeans.to_dict())
    r = scipy_stats.pearsonr(rows["grad_norm_ratio"], rows["ppl"])
    found = {c["x"]: c for c in comparison["gradient_correlations"]}["grad_norm_ratio"]
    assert found["y"] == "ppl" and found["r"] == pytest.approx(r.statistic) and found["p"] == pytest.approx(r.pvalue)


def test_the_real_grid_figures_hold_geometric_means_and_method_bars_of_ppl(copied, written):
    _, rows = copied
    _, out = written
    heat = json.loads((out / "figures" / "heatmap_smollm2-135m.json").read_text())
    assert heat["metric"] == "ppl" and heat["aggregate"] == "geometric mean"
    for i, s in enumerate(heat["seq_lens"]):
        for j, n in enumerate(heat["num_samples"]):
            cell = rows[(rows["taylor_seq_len"] == s) & (rows["taylor_num_samples"] == n)]["ppl"]
            assert heat["values"][i][j] == pytest.approx(float(np.exp(np.log(cell).mean())))
    bars = json.loads((out / "figures" / "methods_by_models.json").read_text())
    assert bars["aggregate"] == "geometric mean"
    for k, method in enumerate(bars["methods"]):
        logs = np.log(rows[rows["pruning_method"] == method]["ppl"])
        assert bars["means"][k][0] == pytest.approx(float(np.exp(logs.mean())))
        assert bars["stds"][k][0] == pytest.approx(float(np.exp(logs.std())))
    for png in ("heatmap_smollm2-135m.png", "methods_by_models.png"):
        assert (out / "figures" / png).stat().st_size > 10_000
    text = (out / "final_analysis_report.txt").read_text()
    assert "ranked by ppl (lower is better)" in text and "Overall best by ppl: SMOLLM2-135M" in text


def test_the_real_grid_latex_tables_speak_perplexity_and_equal_numpy(copied, written):
    """Ranked by ppl, the paper tables show geometric means, means and the lowest value, the lowest in bold (an
    accuracy's labels and its highest-is-best bold would call the worst method the best)."""
    _, rows = copied
    _, out = written
    paper = out / "paper"
    gmean = lambda values: float(np.exp(np.log(values).mean()))  # noqa: E731
    (best,) = latex_rows((paper / "table1_best_configs.tex").read_text())
    assert "chosen by the lowest wiki perplexity" in (paper / "table1_best_configs.tex").read_text()
    assert best[5] == (f"{rows['ppl'].min():.2f}", True) and best[4][1] is False
    methods = (paper / "table3_method_comparison.tex").read_text()
    assert r"\textbf{Geo-mean PPL} & \textbf{Mean PPL} & \textbf{Best PPL}" in methods and "ACC" not in methods
    by_method = rows.groupby("pruning_method")["ppl"]
    lowest = by_method.apply(gmean).idxmin()
    for cells in latex_rows(methods):
        method = cells[1][0].lower()
        ppl = rows[rows["pruning_method"] == method]["ppl"]
        assert [c[0] for c in cells[2:]] == [f"{gmean(ppl):.2f}", f"{ppl.mean():.2f}", f"{ppl.min():.2f}"]
        assert [c[1] for c in cells[2:]] == [method == lowest, False, False]
    (cells,) = latex_rows((paper / "table4_seq_len.tex").read_text())
    by_seq = rows.groupby("taylor_seq_len")["ppl"].apply(gmean).sort_index()
    assert [c[0] for c in cells[1:-1]] == [f"{v:.2f}" for v in by_seq]
    assert [c[1] for c in cells[1:-1]] == [s == by_seq.idxmin() for s in by_seq.index]
    falling = by_seq.is_monotonic_decreasing
    assert cells[-1][0] == ("monotonic decrease" if falling else "monotonic increase")
    assert "(best by wiki perplexity)" in (paper / "table2_task_accuracy.tex").read_text()


REAL_SEEDS = REAL_GRID.parent / "real_grid_seeds"  # experiments/real_grid_seeds.yaml: two configurations x 3 seeds


def test_the_real_seed_spread_names_its_configurations_and_equals_pandas(tmp_path):
    if not REAL_SEEDS.is_dir():
        pytest.fail(f"{REAL_SEEDS} is missing: the seeds sweep's export is part of the repository")
    rows = pd.DataFrame([final_report(f) for f in sorted(REAL_SEEDS.iterdir()) if (f / "result.json").is_file()])
    assert len(rows) == 6 and rows["seed"].nunique() == 3
    write_report(build_report(str(REAL_SEEDS)), tmp_path)
    spread = json.loads((tmp_path / "consolidated_smollm2-135m" / "method_comparison.json").read_text())["seed_spread"]
    # each record says which configuration it is (a grouped table's keys were dropped from the JSON)
    written = pd.DataFrame(spread["table"]).set_index(["pruning_method", "taylor_seq_len", "taylor_num_samples"])
    expected = rows.groupby(["pruning_method", "taylor_seq_len", "taylor_num_samples"])["ppl"]
    assert sorted(written.index) == sorted(expected.groups)
    for key, values in expected:
        assert written.loc[key, "mean"] == pytest.approx(values.mean())
        assert written.loc[key, "std"] == pytest.approx(np.std(values.to_numpy(), ddof=1))
        assert (written.loc[key, "min"], written.loc[key, "max"], written.loc[key, "count"]) == (
            values.min(),
            values.max(),
            3,
        )
