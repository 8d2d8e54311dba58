"""Survivors of `make mutation` in reporting/stats.py, killed by checking behaviour against independent
computations: the held-out selection against a loop over the trials, Kendall's bootstrap interval against a loop
that counts pairs by hand, and the Wilson interval's edges as its definition states them."""

import itertools
import math

import numpy as np
import pandas as pd
import pytest

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


def test_kendall_tau_interval_is_nan_where_no_resample_has_three_configurations():
    got = stats.kendall_tau([1.0, 2.0], [2.0, 1.0], draws=50)
    assert got["tau"] == -1.0 and all(math.isnan(v) for v in got["ci95"]) and got["configurations"] == 2


@pytest.mark.parametrize("accuracy, n", [(0.5, 0), (0.5, None), (None, 10), (math.nan, 10), (math.inf, 10)])
def test_wilson_interval_is_none_without_items_or_an_accuracy(accuracy, n):
    assert stats.wilson_interval(accuracy, n) is None

