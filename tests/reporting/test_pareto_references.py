"""Survivors of `make mutation` in reporting/pareto.py, killed by behaviour checked against loops: which
configurations miss an objective, what a constraint holds for non-numbers, the parse limits the error names, the
uncertainty of a per-task accuracy and of a speed, the resolution test in both directions, each point's family, and
the best under constraints with its ties."""

import math

import numpy as np
import pandas as pd
import pytest

from taylor_tune.reporting import pareto
from taylor_tune.reporting.stats import Objective

MAX, MIN = Objective("acc_mean", "max"), Objective("ppl", "min")


def frame(n: int = 8, seed: int = 0, **extra) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"trial_id": [f"t{i}" for i in range(n)], "pruning_method": "taylor",
                         "sparsity": [0.1 * (i + 1) for i in range(n)], "acc_mean": rng.uniform(0.3, 0.6, n).round(2),
                         "acc_mean_stderr": 0.01, "ppl": rng.uniform(10, 90, n).round(0), **extra})


def test_configurations_missing_an_objective_are_counted_and_the_rest_numbered_afresh():
    df = frame()
    df.loc[[2, 5], "ppl"] = math.nan
    front = pareto.pareto_front(df, (MAX, MIN))
    assert front.attrs["left_out"] == sum(math.isnan(v) for v in df["ppl"]) == 2
    assert sorted(front["point"]) == sorted(t for t, p in zip(df["trial_id"], df["ppl"]) if not math.isnan(p))
    assert "index" not in front.columns and list(front.index) == list(range(len(df) - 2))


def test_the_front_breaks_ties_in_its_first_objective_by_the_point_id():
    df = frame(6).assign(acc_mean=0.5, ppl=[30.0, 30.0, 30.0, 20.0, 20.0, 20.0])
    df["trial_id"] = ["t5", "t3", "t4", "t9", "t1", "t7"]
    front = pareto.pareto_front(df, (MAX, MIN))
    want = sorted(df["trial_id"][df["ppl"] == 20.0]) + sorted(df["trial_id"][df["ppl"] == 30.0])
    assert list(front["point"]) == want and list(front["on_front"]) == [True] * 3 + [False] * 3


def test_a_constraint_holds_only_for_numbers_that_meet_it():
    values = pd.Series([1.0, math.nan, "fast", 2.0, None, 1.5], dtype=object)
    got = pareto.parse_constraint("decode_speedup >= 1.5").holds(values)
    by_hand = [isinstance(v, float) and not math.isnan(v) and v >= 1.5 for v in values]
    assert got.dtype == bool and list(got) == by_hand
    nullable = pd.Series([1.0, None, 2.0], dtype="Float64")  # comparisons with pd.NA give NA, not False
    assert list(pareto.parse_constraint("x>=1.5").holds(nullable)) == [False, False, True]


def test_a_constraint_prints_its_number_as_written_or_else_its_value():
    assert str(pareto.parse_constraint("decode_speedup>=1.50")) == "decode_speedup>=1.50"
    assert str(pareto.Constraint("memory_ratio", "<", 0.5)) == "memory_ratio<0.5"


def test_the_length_limit_and_the_shown_text_are_what_the_error_says():
    limit = pareto.MAX_CONSTRAINT
    longest = "m" * (limit - len(">=1")) + ">=1"
    assert len(longest) == limit and pareto.parse_constraint(longest).metric == "m" * (limit - 3)
    with pytest.raises(ValueError) as refused:
        pareto.parse_constraint("m" + longest)
    assert str(refused.value).startswith(f"{('m' + longest)[:60]!r}... ({limit + 1} characters) is not a constraint")
    for text in ("x" * 60, "x" * 59):  # shown whole up to 60 characters
        with pytest.raises(ValueError, match=rf"^{text!r} is not a constraint"):
            pareto.parse_constraint(text)
    with pytest.raises(ValueError, match=r"^'x{60}'\.\.\. \(61 characters\) is not"):
        pareto.parse_constraint("x" * 61)


def rms(values) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values))


def test_each_metric_reads_its_own_measurement_error():
    df = pd.DataFrame({"trial_id": ["a", "b"], "pruning_method": "taylor", "sparsity": 0.2, "seed": [0, 1],
                       "acc_mean": [0.5, 0.5], "acc_mean_stderr": [0.9, 0.9],
                       "acc_piqa": [0.6, 0.6], "acc_piqa_stderr": [0.03, 0.04],
                       "decode_speedup": [1.2, 1.2], "decode_speedup_se": [0.05, 0.01],
                       "memory_ratio": [0.8, 0.8], "memory_ratio_se": ["n/a", "n/a"],
                       "prefill_speedup": [1.1, 1.1], "prefill_speedup_se": [math.inf, 0.1], "ppl": ["n/a", 20.0]})
    row = pareto.configurations(df, ["acc_piqa", "decode_speedup", "memory_ratio", "prefill_speedup", "ppl",
                                     "absent"]).iloc[0]
    # equal values over the seeds: the seed spread is 0, so the error is the measurement's alone
    assert row["acc_piqa_se"] == pytest.approx(rms([0.03, 0.04]), abs=1e-15)
    assert row["decode_speedup_se"] == pytest.approx(rms([0.05, 0.01]), abs=1e-15)
    # an unreadable or infinite error is unknown: the seed spread (0) alone
    assert row["memory_ratio_se"] == 0.0 and row["prefill_speedup_se"] == 0.0
    assert math.isnan(row["ppl"])  # an unreadable value makes the mean unknown, not an error
    assert math.isnan(row["absent"]) and math.isnan(row["absent_se"])


def test_configurations_group_every_dimension_even_unset_ones_and_need_none():
    df = frame(6, depth_share=[0.25, math.nan, math.nan, 0.25, math.nan, 0.5]).assign(sparsity=0.2)
    got = pareto.configurations(df, ["acc_mean"])
    by_hand = {}
    for t, share, acc in zip(df["trial_id"], df["depth_share"], df["acc_mean"]):
        by_hand.setdefault("nan" if math.isnan(share) else share, []).append((t, acc))
    assert len(got) == len(by_hand) == 3
    for share, members in by_hand.items():
        row = got[got["depth_share"].isna()] if share == "nan" else got[got["depth_share"] == share]
        assert row["trials"].item() == ";".join(sorted(t for t, _ in members))
        assert row["acc_mean"].item() == pytest.approx(np.mean([a for _, a in members]))
    bare = pareto.configurations(df[["trial_id", "acc_mean"]], ["acc_mean"])
    assert len(bare) == 1 and bare["seeds"].item() == 6


def resolved_by_hand(values, errors, modes, z) -> np.ndarray:
    n = len(values)
    out = np.zeros((n, n), dtype=bool)
    for i in range(n):
        for j in range(n):
            for k, mode in enumerate(modes):
                lead = values[i][k] - values[j][k] if mode == "max" else values[j][k] - values[i][k]
                se_i, se_j = (0.0 if math.isnan(e) else e for e in (errors[i][k], errors[j][k]))
                if lead > z * math.sqrt(se_i ** 2 + se_j ** 2):
                    out[i, j] = True
    return out


@pytest.mark.parametrize("seed", range(3))
def test_resolved_equals_a_loop_in_both_directions_with_unknown_errors(seed):
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 4, (7, 2)).astype(float)  # coarse: many equal leads, where > and >= differ
    errors = rng.choice([0.0, 0.2, math.nan], (7, 2))
    objectives = (Objective("acc_mean", "max"), Objective("ppl", "min"))
    got = pareto.resolved(values, errors, objectives, 1.96)
    assert (got == resolved_by_hand(values, errors, ("max", "min"), 1.96)).all()


def test_each_point_is_named_width_depth_or_mixed_by_its_method_and_depth_share():
    df = frame(4).assign(pruning_method=["taylor", "depth", "taylor", "blockwise"])
    no_share = pareto.pareto_front(df, (MAX, MIN))
    assert list(no_share.columns[:2]) == ["point", "family"]
    assert dict(zip(no_share["point"], no_share["family"])) == {"t0": "width", "t1": "depth", "t2": "width",
                                                                "t3": "width"}
    shared = pareto.pareto_front(df.assign(depth_share=[0.0, math.nan, 0.5, math.nan]), (MAX, MIN))
    assert dict(zip(shared["point"], shared["family"])) == {"t0": "width", "t1": "depth", "t2": "mixed",
                                                            "t3": "width"}


def test_the_best_under_constraints_names_its_objective_and_takes_the_smaller_point_on_a_tie():
    df = frame(6).assign(acc_mean=[0.5, 0.6, 0.6, 0.4, 0.6, 0.3], ppl=[20, 30, 10, 40, 25, 90])
    df["trial_id"] = ["t4", "t8", "t6", "t1", "t2", "t0"]
    got = pareto.best_under(df, (pareto.parse_constraint("ppl<=30"),), MAX)
    assert got["objective"] == {"metric": "acc_mean", "mode": "max"} and got["reason"] is None
    meeting = [(a, t) for t, a, p in zip(df["trial_id"], df["acc_mean"], df["ppl"]) if p <= 30]
    best = max(a for a, _ in meeting)
    assert got["satisfying"] == len(meeting) and got["best"]["point"] == min(t for a, t in meeting if a == best)
    none = pareto.best_under(df, (pareto.parse_constraint("ppl<5"),), MAX)
    assert none["best"] is None and none["reason"] == "no configuration meets every constraint"


def test_the_best_under_no_constraints_is_the_best_configuration_of_all():
    df = frame(8, seed=3)
    got = pareto.best_under(df, (), MAX)
    best = df.sort_values(["acc_mean", "trial_id"], ascending=[False, True]).iloc[0]
    assert (got["satisfying"], got["of"], got["reason"]) == (8, 8, None)
    assert got["best"]["point"] == best["trial_id"] and got["best"]["acc_mean"] == best["acc_mean"]
    assert pareto.best_under(df, (), MIN)["best"]["point"] == df.loc[df["ppl"].idxmin(), "trial_id"]


@pytest.mark.parametrize("ppls", [[1.0, 4.0], [30.0, 30.5], [12.0, 13.0, 90.0]])
def test_a_configurations_perplexity_over_seeds_is_scipys_geometric_mean(ppls):
    # one seed may reach perplexity 1 (a perfect prediction), and seeds may differ by less than one
    from scipy.stats import gmean

    df = pd.DataFrame({"trial_id": [f"t{i}" for i in range(len(ppls))], "pruning_method": "taylor",
                       "seed": range(len(ppls)), "ppl": ppls})
    table = pareto.configurations(df, ["ppl"])
    assert len(table) == 1 and table.loc[0, "ppl"] == pytest.approx(gmean(ppls), rel=1e-12)
