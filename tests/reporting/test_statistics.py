"""Reporting's statistics on synthetic trial tables with known answers, each against an independent computation."""

import inspect
import math
import statistics

import pandas as pd
import pytest

from taylor_tune.reporting import (
    build_report,
    plots,
    stats,
)
from tests.report_helpers import (
    EFFECTS,
    METHODS,
    SAMPLES,
    SEQ_LENS,
    TASKS,
    by_hand,
    pearson_by_hand,
    synthetic_trials,
)


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


def test_a_reports_importance_is_fanova_with_its_seed_computed_once_when_first_read(monkeypatch):
    real, calls = stats.hyperparameter_importance, []

    def spy(*args, **kwargs):  # the function itself is checked against Optuna's fANOVA in test_stats_references
        calls.append((inspect.signature(real).bind(*args, **kwargs).arguments, real(*args, **kwargs)))
        return calls[-1][1]

    monkeypatch.setattr(stats, "hyperparameter_importance", spy)
    m = build_report(synthetic_trials(), seed=3).models["model-a"]
    assert calls == []  # building the report ran no fANOVA
    assert m.importance is m.importance and len(calls) == 1  # computed when first read, once
    arguments, returned = calls[0]
    assert arguments.keys() == {"df", "seed", "objective"}  # every searched parameter (params left to its default)
    assert arguments["df"] is m.valid and arguments["seed"] == 3 and arguments["objective"] == m.objective
    assert m.importance is returned


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


def test_the_method_comparison_names_the_baselines_criteria_apart():
    """taylor, its activation baselines, a layerwise baseline and methods whose criterion means nothing (magnitude,
    depth): the comparison's groups and means against a pandas groupby over labels written out by hand."""
    from taylor_tune.reporting.stats import ACCURACY, method_comparison

    df = pd.DataFrame({
        "pruning_method": ["taylor", "taylor", "taylor", "taylor", "layerwise", "magnitude", "depth", "blockwise"],
        "criterion": ["taylor", "flap", "flap", "wanda_sp", "wanda_sp", "l2", "taylor", None],
        "acc_mean": [0.50, 0.40, 0.44, 0.45, 0.43, 0.30, 0.35, 0.41], "trial_id": [f"t{i}" for i in range(8)],
    })
    labels = ["taylor", "taylor+flap", "taylor+flap", "taylor+wanda_sp", "layerwise+wanda_sp", "magnitude", "depth",
              "blockwise"]
    table = method_comparison(df, ACCURACY)["table"]
    expected = df.assign(label=labels).groupby("label")["acc_mean"].mean()
    assert set(table.index) == set(labels)
    for label, mean in expected.items():
        assert table.loc[label, "mean"] == pytest.approx(mean)
    assert method_comparison(df, ACCURACY)["best_method"] == "taylor"


def test_a_trials_layout_is_named_from_its_settings_whatever_the_table_holds():
    """The speed table's and the figures' `layout`: numpy bools, NaN for a setting a trial did not have, a table
    without the newer columns (a sweep from before they existed reads free or uniform)."""
    import numpy as np

    from taylor_tune.reporting.stats import layout_names, speed_quality

    df = pd.DataFrame({
        "trial_id": list("abcdefg"),
        "pruning_method": ["taylor", "taylor", "layerwise", "taylor", "depth", "taylor", "random"],
        "uniform": np.array([False, True, False, False, False, np.nan, False], dtype=object),
        "align": [np.nan, np.nan, 128.0, 512.0, np.nan, np.nan, 64],
        "servable": [False, False, False, True, False, np.nan, np.bool_(False)],
        "decode_speedup": [1.0, 1.3, 1.2, 1.1, 1.5, 0.9, 1.25],
    })
    hand = ["free", "uniform", "align 128", "servable", "depth", "free", "align 64"]
    assert layout_names(df) == hand
    assert layout_names(df.drop(columns=["align", "servable"])) == ["free", "uniform", "free", "free", "depth", "free",
                                                                    "free"]
    table = speed_quality(df)
    assert list(table.columns[:3]) == ["trial_id", "pruning_method", "layout"]
    assert dict(zip(table["trial_id"], table["layout"])) == dict(zip(df["trial_id"], hand))
