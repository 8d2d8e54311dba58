"""Survivors of `make mutation` in reporting/stats.py, killed by checking behaviour against independent
computations: the held-out selection against a loop over the trials, Kendall's bootstrap interval against a loop
that counts pairs by hand, and the Wilson interval's edges as its definition states them."""

import itertools
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as scipy_stats

from taylor_tune.reporting import stats

TASKS = ("boolq", "piqa", "arc_easy")


def halves(seed: int, n: int = 7) -> pd.DataFrame:
    """n trials with per-half accuracies; two of them tie on the selection half (the first must win)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        row = {"trial_id": f"t{i}", "pruning_method": ["taylor", "layerwise", "blockwise"][i % 3],
               "taylor_seq_len": [64, 128][i % 2], "taylor_num_samples": 32 * (i + 1)}
        for t in TASKS:
            row[f"acc_{t}_sel"], row[f"acc_{t}_heldout"] = rng.uniform(0.3, 0.8, 2).round(2)
        rows.append(row)
    best = max(range(n), key=lambda i: sum(rows[i][f"acc_{t}_sel"] for t in TASKS))
    twin = (best + 3) % n
    for t in TASKS:
        rows[twin][f"acc_{t}_sel"] = rows[best][f"acc_{t}_sel"]
    return pd.DataFrame(rows)


def heldout_by_hand(df: pd.DataFrame) -> dict:
    records = df.to_dict(orient="records")
    sel = [sum(r[f"acc_{t}_sel"] for t in TASKS) / len(TASKS) for r in records]
    held = [sum(r[f"acc_{t}_heldout"] for t in TASKS) / len(TASKS) for r in records]
    i = next(k for k, s in enumerate(sel) if s == max(sel))  # the first of the best
    return {"chosen": records[i]["trial_id"], "selection_acc": sel[i], "heldout_acc": held[i],
            "optimism": sel[i] - held[i], "best_heldout_acc": max(held),
            "config": {k: records[i][k] for k in ("pruning_method", "taylor_seq_len", "taylor_num_samples")}}


@pytest.mark.parametrize("seed", range(4))
def test_heldout_selection_equals_a_loop_over_the_trials(seed):
    df = halves(seed)
    got, want = stats.heldout_selection(df, TASKS), heldout_by_hand(df)
    assert got["reason"] is None and got["chosen"] == want["chosen"] and got["config"] == want["config"]
    for key in ("selection_acc", "heldout_acc", "optimism", "best_heldout_acc"):
        assert got[key] == pytest.approx(want[key], abs=1e-12), key


def test_heldout_selection_breaks_ties_by_the_first_trial_even_among_many():
    # numpy's default quicksort orders ties arbitrarily once an array is long; the stable sort keeps the first
    rng = np.random.default_rng(0)
    level = rng.integers(0, 3, 300) / 2
    df = pd.DataFrame({"trial_id": [f"t{i}" for i in range(300)], "pruning_method": "taylor", "taylor_seq_len": 64,
                       "taylor_num_samples": 32,
                       **{f"acc_{t}_{half}": level for t in TASKS for half in ("sel", "heldout")}})
    assert stats.heldout_selection(df, TASKS)["chosen"] == heldout_by_hand(df)["chosen"] == f"t{np.argmax(level)}"


def test_heldout_selection_says_why_it_cannot_choose():
    df = halves(0)
    assert stats.heldout_selection(df.iloc[:0], TASKS)["reason"] == "no valid trials"
    assert stats.heldout_selection(df, ())["reason"] == "no valid trials"
    for broken in (df.drop(columns=["acc_piqa_heldout"]), df.drop(columns=["acc_boolq_sel"]),
                   df.assign(acc_arc_easy_heldout=[math.nan] + [0.5] * (len(df) - 1)),
                   df.assign(acc_piqa_sel=[0.5] * (len(df) - 1) + [math.nan])):
        assert stats.heldout_selection(broken, TASKS)["reason"].startswith("the trials did not record per-half")


def tau_b_by_hand(x, y) -> float:
    """Kendall's tau-b from the pairs: (concordant - discordant) / sqrt((n0 - ties in x) (n0 - ties in y))."""
    pairs = list(itertools.combinations(range(len(x)), 2))
    s = sum(np.sign(x[i] - x[j]) * np.sign(y[i] - y[j]) for i, j in pairs)
    tx, ty = (sum(v[i] == v[j] for i, j in pairs) for v in (x, y))
    denominator = math.sqrt((len(pairs) - tx) * (len(pairs) - ty))
    return s / denominator if denominator else math.nan


def bootstrap_by_hand(x, y, draws: int, seed: int) -> list[float]:
    """The documented percentile bootstrap: `draws` resamples of the configurations in pairs (numpy's default
    generator seeded with `seed`), those with fewer than three distinct configurations or an undefined tau left
    out, the 2.5th and 97.5th percentiles of the rest."""
    rng, taus = np.random.default_rng(seed), []
    for _ in range(draws):
        pick = rng.integers(0, len(x), len(x))
        if len(set(pick.tolist())) >= 3:
            tau = tau_b_by_hand(x[pick], y[pick])
            if not math.isnan(tau):
                taus.append(tau)
    return [float(v) for v in np.percentile(taus, [2.5, 97.5])]


@pytest.mark.parametrize("seed", [0, 5])
def test_kendall_tau_interval_equals_a_bootstrap_by_hand(seed):
    rng = np.random.default_rng(11)
    x = rng.permutation(12).astype(float)
    y = np.round(x + rng.normal(0, 8, 12))  # ties (tau-b is not tau-a) and a wide interval (neither end at 1)
    got = stats.kendall_tau(x, y, draws=150, seed=seed)
    assert got["tau"] == pytest.approx(tau_b_by_hand(x, y), abs=1e-12)
    assert got["ci95"] == pytest.approx(bootstrap_by_hand(x, y, 150, seed), abs=1e-12)
    assert stats.kendall_tau(x, y, seed=seed)["ci95"] == pytest.approx(bootstrap_by_hand(x, y, 2000, seed), abs=1e-12)


@pytest.mark.parametrize("cells", [1, 50, 1 << 22])  # a block of one row, blocks that split the rows, one block
def test_tau_b_of_many_rows_at_once_equals_scipy_row_by_row(cells):
    rng = np.random.default_rng(2)
    for n in (1, 2, 3, 7, 20):
        x = np.round(rng.normal(0, 2, (9, n)))  # ties in both
        y = np.round(x + rng.normal(0, 2, (9, n)))
        x[0], y[1] = 1.0, 2.0  # a constant row in each: tau-b undefined
        got = stats._tau_b_rows(x, y, cells=cells)
        for k in range(len(x)):
            want = scipy_stats.kendalltau(x[k], y[k]).statistic if n > 1 else math.nan
            assert got[k] == pytest.approx(want, abs=1e-12, nan_ok=True), (n, k)


def test_kendall_tau_interval_is_nan_where_no_resample_has_three_configurations():
    got = stats.kendall_tau([1.0, 2.0], [2.0, 1.0], draws=50)
    assert got["tau"] == -1.0 and all(math.isnan(v) for v in got["ci95"]) and got["configurations"] == 2


@pytest.mark.parametrize("accuracy, n", [(0.5, 0), (0.5, None), (None, 10), (math.nan, 10), (math.inf, 10)])
def test_wilson_interval_is_none_without_items_or_an_accuracy(accuracy, n):
    assert stats.wilson_interval(accuracy, n) is None



@pytest.mark.parametrize("mode", ["max", "min"])
def test_an_objectives_loss_is_how_much_worse_in_its_own_direction(mode):
    objective = stats.Objective("acc_mean" if mode == "max" else "ppl", mode)
    for best, value in ((0.6, 0.5), (10.0, 14.0), (3.0, 3.0)):
        worse_by = (best - value) if mode == "max" else (value - best)
        assert objective.loss(best, value) == pytest.approx(worse_by, abs=1e-12)


@pytest.mark.parametrize("z", [1.0, 1.959963984540054, 2.5758])
def test_coverage_is_the_normal_probability_within_z(z):
    from scipy.stats import norm

    assert stats.coverage(z) == pytest.approx(norm.cdf(z) - norm.cdf(-z), abs=1e-12)


def test_an_interval_without_a_standard_error_is_none():
    assert stats.confidence_interval(0.5, None) is None and stats.confidence_interval(0.5, math.nan) is None


def test_the_seed_spread_equals_a_loop_over_configurations_with_several_seeds():
    rows = []
    for method, seeds in (("taylor", 3), ("layerwise", 1), ("blockwise", 2)):
        for seed in range(seeds):
            rows.append({"trial_id": f"{method}{seed}", "pruning_method": method, "taylor_seq_len": 64,
                         "taylor_num_samples": 32, "depth_share": math.nan, "seed": seed,
                         "acc_mean": 0.4 + 0.01 * seed + 0.1 * (method == "taylor")})
    df = pd.DataFrame(rows)
    got = stats.seed_spread(df)
    by_hand = {}
    for method in ("taylor", "blockwise"):  # a configuration with one seed has no spread
        values = df[df["pruning_method"] == method]["acc_mean"].tolist()
        by_hand[method] = (np.mean(values), np.std(values, ddof=1), len(values))
    table = got["table"].reset_index()
    assert got["reason"] is None and sorted(table["pruning_method"]) == sorted(by_hand)
    for _, row in table.iterrows():
        mean, std, count = by_hand[row["pruning_method"]]
        assert (row["mean"], row["std"], row["count"]) == (pytest.approx(mean), pytest.approx(std), count)
    assert got["mean_std"] == pytest.approx(np.mean([s for _, s, _ in by_hand.values()]))
    single = stats.seed_spread(df[df["pruning_method"] == "layerwise"])
    assert single["table"] is None and single["reason"].startswith("one calibration seed per configuration")
    assert stats.seed_spread(df.drop(columns=["seed"])) == {"table": None, "reason": "no seed column"}
    assert stats.seed_spread(df.iloc[:0]) == {"table": None, "reason": "no seed column"}


def test_the_extreme_layers_correlation_is_pearsons_over_the_trials():
    from scipy.stats import pearsonr

    rng = np.random.default_rng(2)
    df = pd.DataFrame({"extreme_pruning_layers": rng.integers(0, 5, 12), "acc_mean": rng.uniform(0.3, 0.6, 12),
                       "ppl": rng.uniform(10, 50, 12)})
    for objective in (stats.ACCURACY, stats.Objective("ppl", "min")):
        got = stats.extreme_layers(df, objective)["correlation"]
        want = pearsonr(df["extreme_pruning_layers"], df[objective.metric])
        assert (got.x, got.y, got.n) == ("extreme_pruning_layers", objective.metric, 12)
        assert got.r == pytest.approx(want.statistic, abs=1e-12) and got.p == pytest.approx(want.pvalue, rel=1e-9)


def test_a_correlation_says_what_it_left_out():
    df = pd.DataFrame({"x": [1.0, 2.0, 3.0, 4.0, math.inf, math.nan], "acc_mean": [0.1, 0.3, 0.2, 0.5, 0.4, 0.3]})
    text = stats.correlation(df, "x").describe()
    assert text.endswith("n = 4; left out: inf 1, missing 1)")
    assert stats.correlation(df.iloc[:4], "x").describe().endswith("n = 4)")


def test_the_impact_of_a_parameter_on_no_trials_has_no_best_value():
    empty = pd.DataFrame({"pruning_method": pd.Series(dtype=str), "acc_mean": pd.Series(dtype=float)})
    got = stats.hyperparameter_impact(empty, "pruning_method")
    assert got["best_value"] is None and got["best_mean"] is None and got["table"].empty


def test_the_impact_of_a_parameter_is_its_best_groups_mean():
    df = pd.DataFrame({"pruning_method": ["taylor", "taylor", "random", "blockwise"],
                       "acc_mean": [0.5, 0.7, 0.2, 0.55], "ppl": [20.0, 10.0, 90.0, 12.0]})
    got = stats.hyperparameter_impact(df, "pruning_method")
    assert got["best_value"] == "taylor" and got["best_mean"] == pytest.approx(0.6)
    by_ppl = stats.hyperparameter_impact(df, "pruning_method", stats.Objective("ppl", "min"))
    assert by_ppl["best_value"] == "blockwise" and by_ppl["best_mean"] == pytest.approx(12.0)


def test_summary_equals_a_loop_over_the_groups_with_scipy():
    rng = np.random.default_rng(3)
    df = pd.DataFrame({"seq_len": rng.choice([64, 128, 256], size=40), "ppl": rng.uniform(10, 90, size=40)})
    table = stats.summary(df, "seq_len", "ppl")
    assert list(table.index) == [64, 128, 256] and list(table.columns) == ["gmean", "mean", "std", "min", "max",
                                                                          "count"]
    for value, row in table.iterrows():
        group = df.loc[df["seq_len"] == value, "ppl"].to_numpy()
        expected = [scipy_stats.gmean(group), group.mean(), group.std(ddof=1), group.min(), group.max(), len(group)]
        assert row.to_numpy() == pytest.approx(expected, rel=1e-12)
    assert "gmean" not in stats.summary(df.rename(columns={"ppl": "acc_mean"}), "seq_len").columns


def test_the_geometric_mean_of_equal_perplexities_is_that_perplexity_exactly():
    # exp(log(30.0)) is 30.000000000000004: a group of equal values must still meet ppl<=30
    df = pd.DataFrame({"method": ["a", "a", "b"], "ppl": [30.0, 30.0, 30.0]})
    assert (stats.summary(df, "method", "ppl")["gmean"] == 30.0).all()
    assert stats.geometric_mean([2.0, 8.0]) == pytest.approx(4.0, rel=1e-15)
    assert math.isnan(stats.geometric_mean([]))


def test_value_of_search_matches_a_configuration_with_unset_dimensions_only_to_unset_ones():
    # a width cut leaves depth_share unset (NaN); a mixed cut (the same method with a depth share) sets it. A
    # configuration matches a target's trials whose every dimension is equal or unset in both, never unset on one
    # side only: a's best (taylor, width) is not b's mixed taylor, and b's best (taylor, mixed) is not a's width one.
    rows = [("a", "taylor", math.nan, 0.50), ("a", "depth", 0.5, 0.40), ("b", "taylor", math.nan, 0.30),
            ("b", "taylor", 0.25, 0.46), ("b", "depth", 0.5, 0.20)]
    df = pd.DataFrame([{"trial_id": f"t{i}", "model": m, "pruning_method": method, "depth_share": share,
                        "taylor_seq_len": 64, "taylor_num_samples": 32, "acc_mean": acc}
                       for i, (m, method, share, acc) in enumerate(rows)])
    got = stats.value_of_search(df).set_index(["config_of", "applied_to"])
    for source in ("a", "b"):
        own = df[df["model"] == source]
        best = own.loc[own["acc_mean"].idxmax()]  # distinct accuracies: no tie to break
        for target in ("a", "b"):
            mine = df[df["model"] == target]
            share = best["depth_share"]
            same = [r.acc_mean for r in mine.itertuples() if r.pruning_method == best["pruning_method"] and (
                r.depth_share == share or (math.isnan(r.depth_share) and math.isnan(share)))]
            expected = float(np.mean(same)) if same else math.nan
            assert got.loc[(source, target), "acc_mean"] == pytest.approx(expected, nan_ok=True)
            assert got.loc[(source, target), "loss"] == pytest.approx(mine["acc_mean"].max() - expected, nan_ok=True)


def test_a_correlation_of_three_rows_is_pearsons_and_names_the_absent_column():
    df = pd.DataFrame({"x": [1.0, 2.0, 4.0], "acc_mean": [0.2, 0.5, 0.4]})
    got, want = stats.correlation(df, "x"), scipy_stats.pearsonr(df["x"], df["acc_mean"])
    assert got.n == 3 and got.r == pytest.approx(want.statistic, abs=1e-12)  # three rows are enough
    assert stats.correlation(df.iloc[:2], "x").r is None
    assert stats.correlation(df, "x", "ppl").reason == "column ppl is absent"
    assert stats.correlation(df, "y").reason == "column y is absent"


def test_a_correlation_reads_flags_as_numbers_and_unparsable_cells_as_missing():
    # a boolean column (uniform layout on or off) correlates as 0/1; a cell that is no number is left out as missing
    flag = pd.Series([True, False, True, False, True])
    acc = pd.Series([0.50, 0.42, "n/a", 0.40, 0.47], dtype=object)
    got = stats.correlation(pd.DataFrame({"uniform": flag, "acc_mean": acc}), "uniform")
    keep = [0, 1, 3, 4]
    want = scipy_stats.pearsonr(flag[keep].astype(float), acc[keep].astype(float))
    assert (got.n, got.excluded) == (4, {"inf": 0, "missing": 1})
    assert got.r == pytest.approx(want.statistic, abs=1e-12)
    swapped = stats.correlation(pd.DataFrame({"x": acc, "y": flag}), "x", "y")
    assert swapped.n == 4 and swapped.r == pytest.approx(want.statistic, abs=1e-12)


def test_a_constant_column_is_named_with_its_value_even_for_one_row():
    df = pd.DataFrame({"x": [7.0, 7.0, 7.0], "acc_mean": [0.1, 0.2, 0.3]})
    assert stats.correlation(df, "x").reason == "x is constant (7) over these rows"
    assert stats.correlation(df.iloc[:1], "x", min_rows=1).reason == "x is constant (7) over these rows"
    assert stats.correlation(df.rename(columns={"x": "acc_mean", "acc_mean": "x"}), "x").reason == (
        "acc_mean is constant (7) over these rows")


def leads(acc: list[float], task_se: list[list[float]]) -> pd.DataFrame:
    """Trials t0.. with acc_mean and per-task stderrs over TASKS[:len(task_se[0])]."""
    tasks = TASKS[:len(task_se[0])]
    return pd.DataFrame([{"trial_id": f"t{i}", "acc_mean": a, **{f"acc_{t}_stderr": s for t, s in zip(tasks, se)}}
                         for i, (a, se) in enumerate(zip(acc, task_se))])


def lead_by_hand(df: pd.DataFrame, tasks: tuple[str, ...], z: float) -> dict:
    records = df.to_dict(orient="records")
    se = {r["trial_id"]: math.sqrt(sum(r[f"acc_{t}_stderr"] ** 2 for t in tasks)) / len(tasks) for r in records}
    order = sorted(records, key=lambda r: -r["acc_mean"])  # distinct accuracies, no ppl: no tie-break needed
    best, runner = order[0], order[1]
    gap = {r["trial_id"]: math.hypot(se[best["trial_id"]], se[r["trial_id"]]) for r in order[1:]}
    return {"best": best["trial_id"], "runner_up": runner["trial_id"],
            "difference": best["acc_mean"] - runner["acc_mean"], "stderr": gap[runner["trial_id"]],
            "exceeds": best["acc_mean"] - runner["acc_mean"] > z * gap[runner["trial_id"]],
            "tied": [r["trial_id"] for r in order[1:] if best["acc_mean"] - r["acc_mean"] <= z * gap[r["trial_id"]]]}


@pytest.mark.parametrize("z", [1.0, stats.Z95, 3.0])
@pytest.mark.parametrize("seed", range(3))
def test_the_lead_of_the_best_equals_a_loop_over_the_trials(seed, z):
    # unequal stderrs per trial (the best's own is not the runner's) and a best that is not the first row
    rng = np.random.default_rng(seed)
    n = 6
    df = leads(list(rng.permutation(np.linspace(0.40, 0.46, n))), rng.uniform(0.005, 0.03, (n, 2)).tolist())
    got, want = stats.lead_of_best(df, TASKS[:2], z=z), lead_by_hand(df, TASKS[:2], z)
    assert (got.best, got.runner_up, got.z, got.reason) == (want["best"], want["runner_up"], z, None)
    assert got.difference == pytest.approx(want["difference"], abs=1e-15)
    assert got.stderr == pytest.approx(want["stderr"], rel=1e-12)
    assert got.exceeds_uncertainty is want["exceeds"] and got.tied_with_best == want["tied"]
    assert got.exceeds_uncertainty is (got.runner_up not in got.tied_with_best)


def test_a_lead_of_exactly_z_standard_errors_is_a_tie():
    # dyadic numbers, so the boundary is exact: a gap of 0.25 against z * se = 2 * 0.125
    df = leads([0.75, 0.5, 0.25], [[0.0], [0.125], [0.0]])
    got = stats.lead_of_best(df, TASKS[:1], z=2.0)
    assert (got.difference, got.stderr) == (0.25, 0.125)
    assert got.exceeds_uncertainty is False and got.tied_with_best == ["t1"]


def test_a_lead_with_an_unknown_stderr_says_so_and_decides_nothing():
    df = leads([0.45, 0.40, 0.30], [[0.01], [math.nan], [0.01]])
    got = stats.lead_of_best(df, TASKS[:1])
    assert got.reason.startswith("a task stderr is missing") and got.exceeds_uncertainty is None
    assert got.stderr is None and got.tied_with_best == []


def test_a_lead_by_perplexity_points_to_the_seed_spread():
    df = pd.DataFrame({"trial_id": ["a", "b"], "acc_mean": [0.4, 0.5], "ppl": [20.0, 25.0]})
    got = stats.lead_of_best(df, TASKS, objective=stats.Objective("ppl", "min"))
    assert (got.best, got.runner_up, got.difference) == ("a", "b", 5.0)
    # the report prints this sentence as it is: it names the setting that measures the noise as the user writes it
    assert got.reason == ("ppl has no standard error here; the calibration-seed spread (search.repeats > 1) is its "
                          "noise")


@pytest.mark.parametrize("objective", [stats.ACCURACY, stats.Objective("ppl", "min")])
def test_the_method_comparisons_best_accuracy_is_the_best_trials(objective):
    df = pd.DataFrame({"trial_id": ["a", "b", "c"], "pruning_method": ["taylor", "random", "taylor"],
                       "acc_mean": [0.41, 0.45, 0.39], "ppl": [30.0, 80.0, 25.0]})
    got = stats.method_comparison(df, objective)
    chosen = df.loc[df[objective.metric].idxmax() if objective.mode == "max" else df[objective.metric].idxmin()]
    assert got["best_acc"] == chosen["acc_mean"] and got["best_method"] == chosen["pruning_method"]
    empty = stats.method_comparison(df.iloc[:0], objective)
    assert (empty["best_acc"], empty["best_method"], empty["best_value"], empty["best_method_by_mean"]) == (
        None, None, None, None)


def best_by_hand(rows: list[dict], metric: str, mode: str) -> str:
    """The best trial as best_trial's docstring states it, by a plain sort: the metric (a cell that is no number is
    the worst), then the lower ppl (ranking by an accuracy) or the higher acc_mean (ranking by ppl), then the id."""
    def number(cell) -> float:
        try:
            value = float(cell)
        except (TypeError, ValueError):
            return math.nan
        return value

    def key(row):
        value = number(row[metric])
        if metric == "ppl":
            acc = number(row.get("acc_mean"))
            tie = -acc if not math.isnan(acc) else math.inf
        else:
            ppl = number(row.get("ppl"))
            tie = ppl if not math.isnan(ppl) else math.inf
        return (math.isnan(value), 0.0 if math.isnan(value) else (value if mode == "min" else -value), tie,
                row["trial_id"])
    return min(rows, key=key)["trial_id"]


@pytest.mark.parametrize("seed", range(40))
def test_the_best_trial_equals_a_plain_sort_with_ties_missing_cells_and_text(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    acc = [float(v) for v in rng.choice([0.3, 0.4, 0.5], n)]  # few values: ties
    ppl = [float(v) for v in rng.choice([20.0, 30.0, 45.5], n)]
    for column in (acc, ppl):  # a missing or unreadable cell here and there
        for i in rng.choice(n, int(rng.integers(0, 3)), replace=True):
            column[i] = math.nan if rng.random() < 0.7 else "n/a"
    ids = [f"t{i}" for i in rng.permutation(n)]
    rows = [{"trial_id": t, "acc_mean": a, "ppl": p} for t, a, p in zip(ids, acc, ppl)]
    df = pd.DataFrame(rows).astype({"acc_mean": object, "ppl": object})
    for objective, other in ((stats.ACCURACY, "ppl"), (stats.Objective("ppl", "min"), "acc_mean")):
        # the ranking metric and acc_mean may hold text (read as missing); ppl as a tie-break is a number or NaN
        frame = df if other == "acc_mean" else df.assign(ppl=pd.to_numeric(df["ppl"], errors="coerce"))
        want = best_by_hand(rows, objective.metric, objective.mode)
        assert stats.best_trial(frame, objective)["trial_id"] == want
        alone = best_by_hand([{k: v for k, v in r.items() if k != other} for r in rows], objective.metric,
                             objective.mode)
        assert stats.best_trial(frame.drop(columns=other), objective)["trial_id"] == alone


def fanova_by_hand(df: pd.DataFrame, params: list[str], metric: str, mode: str, seed: int = 0) -> dict:
    """Optuna's fANOVA over a study built here: one finished trial per row, the log of a perplexity."""
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.importance import FanovaImportanceEvaluator, get_param_importances

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize" if mode == "min" else "maximize")
    for _, row in df.iterrows():
        value = math.log(row[metric]) if metric == "ppl" else row[metric]
        study.add_trial(optuna.trial.create_trial(
            params={p: row[p] for p in params}, value=float(value),
            distributions={p: CategoricalDistribution(sorted(set(df[p]), key=str)) for p in params}))
    return get_param_importances(study, evaluator=FanovaImportanceEvaluator(seed=seed))


@pytest.mark.parametrize("objective", [stats.ACCURACY, stats.Objective("ppl", "min")])
def test_hyperparameter_importance_is_optunas_fanova_of_the_trials_with_seed_0(objective):
    rng = np.random.default_rng(1)
    df = pd.DataFrame({"trial_id": [f"t{i}" for i in range(24)],
                       "pruning_method": rng.choice(["taylor", "layerwise", "blockwise"], 24),
                       "taylor_seq_len": rng.choice([64, 128], 24), "taylor_num_samples": 32,
                       "acc_mean": rng.uniform(0.3, 0.6, 24), "ppl": rng.uniform(20, 90, 24)})
    got = stats.hyperparameter_importance(df, objective=objective)
    want = fanova_by_hand(df.astype({"taylor_seq_len": int}), ["pruning_method", "taylor_seq_len"],
                          objective.metric, objective.mode)
    assert got["reason"] is None and got["constant"] == ["taylor_num_samples"]
    assert got["of"] == ("log(ppl)" if objective.metric == "ppl" else "acc_mean")
    assert got["importances"] == pytest.approx(dict(want), abs=1e-12)
    other = fanova_by_hand(df, ["pruning_method", "taylor_seq_len"], objective.metric, objective.mode, seed=1)
    assert stats.hyperparameter_importance(df, seed=1, objective=objective)["importances"] == pytest.approx(
        dict(other), abs=1e-12)
