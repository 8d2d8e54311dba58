"""Paired comparisons (issue 64, must-show 2) against independent recomputations on constructed per-item data: the
stratified difference against a pandas groupby, the delta-method standard error against a numpy loop and against the
paired bootstrap, McNemar against scipy's binomial test; and each check fails on a planted bug (a sign, unpaired
items, a task weighted by its items)."""

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from taylor_tune import paired
from taylor_tune.paired import mcnemar, paired_bootstrap, paired_difference, shared

SIZES = {"arc_easy": 300, "boolq": 900, "piqa": 120}  # unequal: an item-weighted mean differs from a task-weighted one


def outcomes(seed: int, accuracy: dict[str, float], flip: float = 0.15, base: pd.Series | None = None) -> pd.Series:
    """Per-item 0/1 outcomes; with `base`, a variant of it that answers a share `flip` of the items otherwise."""
    rng = np.random.default_rng(seed)
    index = pd.MultiIndex.from_tuples([(t, i) for t, n in SIZES.items() for i in range(n)], names=["task", "doc_id"])
    if base is None:
        values = np.concatenate([rng.random(n) < accuracy[t] for t, n in SIZES.items()])
        return pd.Series(values.astype(float), index=index)
    flips = rng.random(len(base)) < flip
    return pd.Series(np.where(flips, 1 - base.to_numpy(), base.to_numpy()), index=index)


@pytest.fixture
def pair():
    a = outcomes(0, {"arc_easy": 0.6, "boolq": 0.7, "piqa": 0.55})
    return a, outcomes(1, {}, base=a)


def check_difference(fn, a, b):
    """fn(a, b) against a pandas groupby (the mean over tasks of the per-task accuracy difference) and a numpy loop
    over tasks and items for the stratified standard error."""
    result = fn(a, b)
    frame = pd.DataFrame({"a": a, "b": b})
    by_task = frame.groupby(level="task").mean()
    assert result.difference == pytest.approx((by_task["a"] - by_task["b"]).mean(), abs=1e-12)
    variance = 0.0
    for task in SIZES:
        d = [a[(task, i)] - b[(task, i)] for i in range(SIZES[task])]
        mean = sum(d) / len(d)
        variance += sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)
    assert result.stderr == pytest.approx(math.sqrt(variance) / len(SIZES), rel=1e-9)
    assert (result.items, result.tasks) == (sum(SIZES.values()), len(SIZES))


def test_the_paired_difference_equals_a_groupby_and_its_error_a_numpy_loop(pair):
    a, b = pair
    check_difference(paired_difference, a, b)
    shuffled = b.sample(frac=1.0, random_state=0)  # the same outcomes in another order: pairing is by item
    check_difference(paired_difference, a, shuffled)


def test_the_bootstrap_agrees_with_the_delta_method(pair):
    a, b = pair
    delta, boot = paired_difference(a, b), paired_bootstrap(a, b, draws=4000, seed=1)
    assert boot.difference == delta.difference and boot.method == "bootstrap"
    assert boot.stderr == pytest.approx(delta.stderr, rel=0.08)


def test_pairing_is_tighter_than_the_independent_bound_here(pair):
    a, b = pair
    independent = math.sqrt(sum(
        (a.xs(t).var(ddof=1) + b.xs(t).var(ddof=1)) / SIZES[t] for t in SIZES)) / len(SIZES)
    assert paired_difference(a, b).stderr < 0.8 * independent  # flip 15%: the variants agree on most items


def test_trials_that_did_not_score_the_same_items_are_not_paired(pair):
    a, b = pair
    assert paired_difference(a, b.iloc[:-1]) is None and mcnemar(a, b.drop(("piqa", 3))) is None
    with pytest.raises(ValueError, match="appears twice"):
        shared(a, pd.concat([b, b.iloc[:1]]))


def check_mcnemar(fn, a, b):
    result = fn(a, b)
    only_a = int(((a == 1) & (b == 0)).sum())
    only_b = int(((a == 0) & (b == 1)).sum())
    assert (result["only_a"], result["only_b"]) == (only_a, only_b)
    expected = stats.binomtest(min(only_a, only_b), only_a + only_b, 0.5).pvalue if only_a + only_b else 1.0
    assert result["p"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("flip", [0.0, 0.01, 0.15, 0.5])
def test_mcnemar_equals_scipys_binomial_test_on_the_discordant_items(pair, flip):
    a, _ = pair
    b = outcomes(2, {}, flip=flip, base=a)
    b.iloc[:40] = 1.0  # an uneven split: b right where a was wrong on some
    for task in SIZES:
        check_mcnemar(mcnemar, a.xs(task, drop_level=False), b.xs(task, drop_level=False))


# planted bugs, each as a user of the module would meet it
def _sign(a, b):
    return paired_difference(b, a)


def _unpaired(a, b):
    return paired_difference(a, pd.Series(b.to_numpy()[::-1], index=b.index))


def _item_weighted(a, b):
    right = paired_difference(a, b)
    return paired.PairedDifference(float((a - b).mean()), right.stderr, right.items, right.tasks, "delta")


def _mcnemar_one_sided(a, b):
    result = mcnemar(a, b)
    return result | {"p": result["p"] / 2}


@pytest.mark.parametrize("check, bug", [(check_difference, _sign), (check_difference, _unpaired),
                                        (check_difference, _item_weighted), (check_mcnemar, _mcnemar_one_sided)])
def test_each_check_fails_on_a_planted_bug(pair, check, bug):
    a, b = pair
    if check is check_mcnemar:
        a, b = a.xs("boolq", drop_level=False), b.xs("boolq", drop_level=False)
    with pytest.raises(AssertionError):
        check(bug, a, b)


def trials_table(series: dict[str, pd.Series]) -> pd.DataFrame:
    """One row per trial as the report holds it: acc_mean and each task's accuracy and lm-eval stderr."""
    rows = []
    for trial_id, s in series.items():
        row = {"trial_id": trial_id}
        for task in SIZES:
            x = s.xs(task)
            row[f"acc_{task}"], row[f"acc_{task}_stderr"] = x.mean(), x.std(ddof=1) / math.sqrt(len(x))
        row["acc_mean"] = np.mean([row[f"acc_{t}"] for t in SIZES])
        rows.append(row)
    return pd.DataFrame(rows)


def test_the_lead_of_the_best_is_judged_paired_where_both_kept_their_items(pair):
    """A variant 2 points below the best on the same items, flipping 4% of them: the independent bound calls it
    tied, the paired test separates it; without outcomes (or on other items) the independent verdict stands."""
    from taylor_tune.reporting.stats import Z95, lead_of_best

    best, _ = pair
    rng = np.random.default_rng(5)
    worse = best.copy()
    right = np.flatnonzero(best.to_numpy() == 1)
    worse.iloc[rng.choice(right, size=int(0.03 * len(best)), replace=False)] = 0.0  # loses 3% of the items
    close = best.copy()  # within noise of the best: per task two items won, two lost, and one more lost in boolq
    for task in SIZES:
        values = best.xs(task).to_numpy()
        won, lost = np.flatnonzero(values == 0)[:2], np.flatnonzero(values == 1)[:2 + (task == "boolq")]
        close.loc[[(task, i) for i in won]] = 1.0
        close.loc[[(task, i) for i in lost]] = 0.0
    df = trials_table({"best": best, "worse": worse, "close": close})
    tasks = tuple(SIZES)
    independent = lead_of_best(df, tasks, Z95)
    assert set(independent.tied_with_best) == {"worse", "close"} and independent.paired == 0
    by_pairs = lead_of_best(df, tasks, Z95, outcomes={"best": best, "worse": worse, "close": close})
    assert by_pairs.paired == 2 and by_pairs.separated_by_pairing == 1
    assert "worse" not in by_pairs.tied_with_best
    gap = paired_difference(best, worse)
    assert gap.separated(Z95) and gap.difference == pytest.approx(df["acc_mean"][0] - df["acc_mean"][1], abs=1e-12)
    other_items = lead_of_best(df, tasks, Z95, outcomes={"best": best, "worse": worse.iloc[:-5], "close": close})
    assert other_items.paired == 1 and "worse" in other_items.tied_with_best  # not the same items: independent


def test_scored_items_take_each_tasks_reported_metric():
    """The report pairs each item's score in acc_mean's sense: per task the column whose mean is acc_<task>."""
    from taylor_tune.reporting.frame import scored_items

    index = pd.MultiIndex.from_tuples([(t, i) for t in ("boolq", "piqa") for i in range(4)], names=["task", "doc_id"])
    frame = pd.DataFrame({"acc": [1, 0, 1, 1, 1, 1, 0, 0], "acc_norm": [np.nan] * 4 + [0, 1, 1, 1]},
                         index=index, dtype=float)
    scored = scored_items(frame, pd.Series({"acc_boolq": 0.75, "acc_piqa": 0.75}))
    assert scored.tolist() == [1, 0, 1, 1, 0, 1, 1, 1]  # boolq by acc, piqa by acc_norm
    assert scored_items(frame, pd.Series({"acc_boolq": 0.75, "acc_piqa": 0.6})) is None  # reproduces neither


def windows(seed: int, count: int = 60, tokens: int = 127, base: pd.DataFrame | None = None) -> pd.DataFrame:
    """Each window's summed NLL over `tokens` predicted tokens; with `base`, a variant whose windows move with it
    (the same text: the windows' difficulty is shared) plus its own smaller noise."""
    rng = np.random.default_rng(seed)
    if base is None:
        nll = tokens * rng.gamma(9.0, 0.4, size=count)
    else:
        nll = base["nll"].to_numpy() * 1.03 + tokens * rng.normal(0, 0.05, size=count)
    return pd.DataFrame({"nll": nll, "tokens": tokens}, index=pd.RangeIndex(count, name="window"))


def test_the_paired_log_perplexity_is_the_log_ratio_of_the_perplexities_and_its_error_a_window_bootstrap():
    """The difference against the two perplexities computed as the evaluation does (exp of the summed NLL over the
    summed tokens); its standard error against a numpy bootstrap over windows (the same windows drawn for both);
    pairing is far tighter than treating the two as independent; other windows are not paired."""
    a = windows(0)
    b = windows(1, base=a)
    result = paired.paired_log_ppl(b, a)
    ppl = {name: math.exp(w["nll"].sum() / w["tokens"].sum()) for name, w in (("a", a), ("b", b))}
    assert result.difference == pytest.approx(math.log(ppl["b"]) - math.log(ppl["a"]), rel=1e-12)
    assert result.method == "windows" and result.items == 60
    rng = np.random.default_rng(7)
    draws = []
    for _ in range(4000):
        pick = rng.integers(0, 60, size=60)
        draws.append(b["nll"].to_numpy()[pick].sum() / b["tokens"].to_numpy()[pick].sum()
                     - a["nll"].to_numpy()[pick].sum() / a["tokens"].to_numpy()[pick].sum())
    assert result.stderr == pytest.approx(np.std(draws, ddof=1), rel=0.08)
    independent = math.hypot(*(np.std(w["nll"] / w["tokens"], ddof=1) / math.sqrt(60) for w in (a, b)))
    assert result.stderr < independent / 3 and result.separated(1.96)
    # planted: the windows paired out of order (a shuffled text) give another error; other windows are not paired
    shuffled = b.iloc[np.random.default_rng(3).permutation(60)].set_axis(b.index)
    assert paired.paired_log_ppl(shuffled, a).stderr > 3 * result.stderr
    assert paired.paired_log_ppl(b.iloc[:59], a) is None
    assert paired.paired_log_ppl(b.assign(tokens=255), a) is None


def test_a_perplexity_ranked_lead_is_judged_paired_on_the_windows():
    """Ranked by ppl: the runner-up's lead in log ppl is the paired window difference, a trial within z paired
    errors is tied, a clearly worse one is not, and one without the best's windows is neither tied nor counted."""
    from taylor_tune.reporting import stats

    best = windows(0)
    close = best.assign(nll=best["nll"] * 1.0005 + np.random.default_rng(1).normal(0, 2.0, 60))
    worse = windows(2, base=best)  # 3% more NLL in every window
    ppl = {name: math.exp(w["nll"].sum() / w["tokens"].sum()) for name, w in
           (("best", best), ("close", close), ("worse", worse))}
    assert ppl["best"] < ppl["close"] < ppl["worse"]
    df = pd.DataFrame({"trial_id": ["best", "close", "worse", "bare"],
                       "ppl": [ppl["best"], ppl["close"], ppl["worse"], ppl["close"] * 1.001]})
    lead = stats.lead_of_best(df, (), objective=stats.Objective("ppl", "min"),
                              windows={"best": best, "close": close, "worse": worse})
    expected = paired.paired_log_ppl(close, best)
    assert (lead.best, lead.runner_up, lead.unit, lead.paired) == ("best", "close", "log ppl", 2)
    assert lead.difference == pytest.approx(math.log(ppl["close"] / ppl["best"]), rel=1e-9)
    assert lead.stderr == expected.stderr and lead.exceeds_uncertainty is False
    assert lead.tied_with_best == ["close"]  # "worse" separated; "bare" kept no windows: not judged
    # without windows, as before: the difference in ppl and no standard error
    plain = stats.lead_of_best(df, (), objective=stats.Objective("ppl", "min"))
    assert plain.unit == "" and plain.stderr is None and plain.difference == pytest.approx(ppl["close"] - ppl["best"])


def test_the_best_is_tested_against_the_runner_up_task_by_task(pair):
    """stats.task_tests: per task, McNemar on that task's items alone (scipy's binomial test on its discordant
    items); empty where the runner-up kept no outcomes, None for a task whose items differ."""
    from taylor_tune.reporting import stats

    a, b = pair
    lead = stats.Lead("a", "b")
    tests = stats.task_tests(lead, {"a": a, "b": b})
    assert sorted(tests) == sorted(SIZES)
    for task, test in tests.items():
        x, y = a.xs(task, level="task"), b.xs(task, level="task")
        only_a, only_b = int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum())
        assert (test["only_a"], test["only_b"]) == (only_a, only_b)
        assert test["p"] == pytest.approx(stats.stats.binomtest(only_a, only_a + only_b, 0.5).pvalue, rel=1e-9)
    assert stats.task_tests(lead, {"a": a}) == {}
    fewer = b.drop(("piqa", 0))
    assert stats.task_tests(lead, {"a": a, "b": fewer})["piqa"] is None
    assert stats.task_tests(lead, {"a": a, "b": fewer})["boolq"] == tests["boolq"]


def test_methods_and_values_compare_paired_by_configuration(pair):
    """stats.paired_levels: each method against the best one, trial by trial at the same other settings. A method
    that answers exactly as the best at every configuration differs by 0 with no error although the configurations
    differ a lot from each other (paired across configurations, it would not); a method whose items are the
    best's flipped differs as the numpy loop over the per-item mean of the pairs says; a trial without a partner or
    without outcomes is left out."""
    from taylor_tune.reporting import stats

    a, b = pair  # two very different answer sheets: the two configurations of the best method
    flipped = {name: 1.0 - items for name, items in (("a", a), ("b", b))}
    df = pd.DataFrame({"trial_id": ["t16", "t32", "same16", "same32", "flip16", "flip32", "lonely"],
                       "pruning_method": ["taylor", "taylor", "layerwise", "layerwise", "random", "random", "random"],
                       "taylor_seq_len": [16, 32, 16, 32, 16, 32, 64], "taylor_num_samples": 8, "seed": 0,
                       "layerwise_max_ratio": None, "depth_share": np.nan})  # unset settings: None and NaN
    outcomes = {"t16": a, "t32": b, "same16": a.copy(), "same32": b.copy(), "flip16": flipped["a"],
                "flip32": flipped["b"]}
    levels = stats.paired_levels(df, "pruning_method", "taylor", outcomes, labels=stats.method_labels(df))
    rows = levels.set_index("level")
    assert rows.loc["layerwise", ["pairs", "difference", "stderr"]].tolist() == [2, 0.0, 0.0]
    d = pd.concat([flipped["a"] - a, flipped["b"] - b], axis=1).mean(axis=1)  # per item, over the two pairs
    per_task = [d[d.index.get_level_values(0) == t].to_numpy() for t in sorted(SIZES)]
    assert rows.at["random", "pairs"] == 2  # "lonely" has no taylor partner at seq_len 64
    assert rows.at["random", "difference"] == pytest.approx(np.mean([x.mean() for x in per_task]), abs=1e-12)
    loop = math.sqrt(sum(np.var(x, ddof=1) / len(x) for x in per_task)) / len(per_task)
    assert rows.at["random", "stderr"] == pytest.approx(loop, rel=1e-12)
    # planted: pairing across configurations (ignoring seq_len) gives layerwise an error it does not have
    crossed = df.assign(taylor_seq_len=[16, 32, 32, 64, 16, 32, 64])  # same16's answers paired with t32's
    crossed = stats.paired_levels(crossed, "pruning_method", "taylor", outcomes,
                                  labels=stats.method_labels(crossed)).set_index("level")
    assert crossed.at["layerwise", "pairs"] == 1 and crossed.at["layerwise", "stderr"] > 0.01
    # a value of seq_len against another, paired by method
    values = stats.paired_levels(df, "taylor_seq_len", 16, outcomes).set_index("level")
    assert values.at[32, "pairs"] == 3 and 64 not in values.index
    assert stats.paired_levels(df, "pruning_method", "taylor", {}, labels=stats.method_labels(df)) is None


def _loop_stderr(a: pd.Series, b: pd.Series) -> float:
    """The task-stratified standard error of acc_mean(a) - acc_mean(b), item by item."""
    variance = 0.0
    for task in SIZES:
        d = [a[(task, i)] - b[(task, i)] for i in range(SIZES[task])]
        mean = sum(d) / len(d)
        variance += sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)
    return math.sqrt(variance) / len(SIZES)


def test_the_fronts_ties_are_judged_on_paired_intervals_against_a_loop():
    """Issue 64, build 4: variants of one model on the same items, each with a speedup timed interleaved with the
    unpruned model (its own 95% interval). A dominated point is tied when, in every objective, its dominator's lead is
    within the paired interval: acc_mean's per-item differences (a loop here), the speedups' log-ratio against the two
    half-widths in quadrature. Without outcomes the independent bound judges acc_mean, and it ties more; the count of
    dominations only the paired intervals resolve is the difference."""
    from taylor_tune.reporting.pareto import pareto_front
    from taylor_tune.reporting.stats import Z95, Objective

    base = outcomes(0, {"arc_easy": 0.6, "boolq": 0.7, "piqa": 0.55})

    def losing(share: float, seed: int) -> pd.Series:  # the base with a share of its right items answered wrong
        rng, variant = np.random.default_rng(seed), base.copy()
        right = np.flatnonzero(base.to_numpy() == 1)
        variant.iloc[rng.choice(right, size=int(share * len(base)), replace=False)] = 0.0
        return variant

    series = {"v0": base, "v1": losing(0.03, 1), "v2": losing(0.005, 2), "v3": outcomes(3, {}, 0.01, base),
              "v4": losing(0.10, 4), "v5": losing(0.06, 5)}
    df = trials_table(series).assign(model="m", seed=0, pruning_method=[f"m{k}" for k in range(len(series))])
    speed = np.array([1.05, 1.05, 1.00, 1.04, 1.30, 1.02])
    width = np.array([0.03, 0.03, 0.03, 0.05, 0.02, 0.04])  # half-widths on the log scale
    df = df.assign(decode_speedup=speed, decode_speedup_low=speed * np.exp(-width),
                   decode_speedup_high=speed * np.exp(width), decode_speedup_se=width / 2,
                   acc_mean_stderr=[math.sqrt(sum(df.at[i, f"acc_{t}_stderr"] ** 2 for t in SIZES)) / len(SIZES)
                                    for i in df.index])
    objectives = (Objective("acc_mean", "max"), Objective("decode_speedup", "max"))
    front = pareto_front(df, objectives, Z95, outcomes=series).set_index("point")
    plain = pareto_front(df, objectives, Z95).set_index("point")
    rows = df.set_index("trial_id")
    expected_ties, separated = {}, 0
    for j in rows.index:
        tied, tied_independent = [], []
        for i in rows.index:
            a, b = rows.loc[i], rows.loc[j]
            if i == j or not (a["acc_mean"] >= b["acc_mean"] and a["decode_speedup"] >= b["decode_speedup"]
                              and (a["acc_mean"] > b["acc_mean"] or a["decode_speedup"] > b["decode_speedup"])):
                continue
            speed_resolved = math.log(a["decode_speedup"] / b["decode_speedup"]) > math.hypot(
                math.log(a["decode_speedup_high"] / a["decode_speedup_low"]) / 2,
                math.log(b["decode_speedup_high"] / b["decode_speedup_low"]) / 2)
            acc_paired = a["acc_mean"] - b["acc_mean"] > Z95 * _loop_stderr(series[i], series[j])
            acc_independent = a["acc_mean"] - b["acc_mean"] > Z95 * math.hypot(a["acc_mean_stderr"],
                                                                              b["acc_mean_stderr"])
            if not (acc_paired or speed_resolved):
                tied.append(i)
            if not (acc_independent or speed_resolved):
                tied_independent.append(i)
        expected_ties[j] = sorted(tied)
        separated += len(set(tied_independent) - set(tied))
        got = front.loc[j, "tied_with"]
        assert (sorted(got.split(";")) if got else []) == sorted(tied), (j, got, tied)
        got = plain.loc[j, "tied_with"]
        assert (sorted(got.split(";")) if got else []) == sorted(tied_independent), (j, got, tied_independent)
    assert separated > 0 and front.attrs["separated_by_pairing"] == separated
    assert front.attrs["paired"] == sum(len(d.split(";")) for d in front["dominated_by"] if d)
    assert any(expected_ties.values())  # the draw leaves ties to find as well


def test_a_configuration_on_other_items_is_judged_on_the_front_by_the_independent_bound():
    """One variant scored fewer items (a trial stopped at a lower fidelity): its pairs fall back to the independent
    bound on acc_mean, and only the speed interval (paired with the unpruned model) is still judged paired."""
    from taylor_tune.reporting.pareto import pareto_front
    from taylor_tune.reporting.stats import Z95, Objective

    base = outcomes(0, {"arc_easy": 0.6, "boolq": 0.7, "piqa": 0.55})
    series = {"a": base, "b": outcomes(3, {}, flip=0.03, base=base)}
    df = trials_table(series).assign(model="m", seed=0, pruning_method=["x", "y"])
    df = df.assign(acc_mean_stderr=0.02, decode_speedup=[1.0, 1.0], decode_speedup_se=0.0)
    objectives = (Objective("acc_mean", "max"), Objective("decode_speedup", "max"))
    shorter = {"a": base, "b": series["b"].iloc[:-7]}
    assert pareto_front(df, objectives, Z95, outcomes=series).attrs["paired"] == 1
    other = pareto_front(df, objectives, Z95, outcomes=shorter)
    assert other.attrs["paired"] == 0
    independent = pareto_front(df, objectives, Z95)
    assert list(other["tied_with"]) == list(independent["tied_with"])


def test_the_fronts_perplexity_ties_are_judged_on_paired_windows_against_a_loop():
    """Lower is better here: a dominator's lead in perplexity is resolved when its log ppl is below by more than z
    paired standard errors over the shared windows (a loop: the delta method for a ratio of sums), the speedups as
    above; a sign slip or an independent judgement fails this."""
    from taylor_tune.reporting.pareto import pareto_front
    from taylor_tune.reporting.stats import Z95, Objective

    rng = np.random.default_rng(11)
    tokens = rng.integers(100, 128, 40).astype(float)
    common = rng.normal(3.0, 0.4, 40) * tokens  # what every variant shares: the windows' own difficulty
    shifts = {"w0": 0.0, "w1": 0.01, "w2": 0.03, "w3": 0.002, "w4": 0.08}
    windows = {k: pd.DataFrame({"nll": common + (shift + rng.normal(0, 0.01, 40)) * tokens, "tokens": tokens})
               for k, shift in shifts.items()}
    ppl = {k: math.exp(w["nll"].sum() / w["tokens"].sum()) for k, w in windows.items()}
    speed = {"w0": 1.05, "w1": 1.05, "w2": 1.0, "w3": 1.04, "w4": 1.3}
    df = pd.DataFrame({"trial_id": list(windows), "model": "m", "seed": 0, "pruning_method": list(windows),
                       "ppl": [ppl[k] for k in windows], "decode_speedup": [speed[k] for k in windows]})
    df = df.assign(decode_speedup_low=df["decode_speedup"] * 0.97, decode_speedup_high=df["decode_speedup"] / 0.97)
    front = pareto_front(df, (Objective("ppl", "min"), Objective("decode_speedup", "max")), Z95,
                         windows=windows).set_index("point")
    ties = 0
    for j in windows:
        tied = []
        for i in windows:
            if i == j or not (ppl[i] <= ppl[j] and speed[i] >= speed[j] and (ppl[i] < ppl[j] or speed[i] > speed[j])):
                continue
            d = (windows[i]["nll"] - windows[j]["nll"]).to_numpy()
            lead = -d.sum() / tokens.sum()  # log ppl(j) - log ppl(i): positive when i is better
            residual = d + lead * tokens
            se = math.sqrt(sum(r * r for r in residual) * len(d) / (len(d) - 1)) / tokens.sum()
            speed_resolved = math.log(speed[i] / speed[j]) > math.hypot(-math.log(0.97), -math.log(0.97))
            if not (lead > Z95 * se or speed_resolved):
                tied.append(i)
        ties += len(tied)
        got = front.loc[j, "tied_with"]
        assert (sorted(got.split(";")) if got else []) == sorted(tied), (j, got, tied)
    assert ties and front.attrs["paired"] == sum(len(d.split(";")) for d in front["dominated_by"] if d)
