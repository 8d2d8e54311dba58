"""A sweep that optimized perplexity (metric: ppl, mode: min): ranked, plotted and tied by it."""

import json
import math
import statistics

import numpy as np
import pandas as pd
import pytest
from scipy import stats as scipy_stats

from taylor_tune.errors import ReportError
from taylor_tune.reporting import (
    build_report,
    plots,
    render_text,
    stats,
    write_report,
)
from tests.report_helpers import (
    SAMPLES,
    SEQ_LENS,
    by_hand,
    pearson_by_hand,
    synthetic_trials,
    write_tune_folder,
)

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


@pytest.mark.slow  # renders the figures: seconds
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
