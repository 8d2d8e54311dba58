"""The Pareto front and the best under constraints, against brute-force recomputations with pandas and scipy."""

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as scipy_stats

from taylor_tune.errors import ReportError
from taylor_tune.reporting import best_under, build_report, pareto_front, parse_constraint
from taylor_tune.reporting.stats import Objective

DIMS = ["pruning_method", "sparsity", "uniform"]


def trials(seeds: int = 2, rng_seed: int = 0, ties: bool = True) -> pd.DataFrame:
    """Configurations of method x sparsity x uniform, each at `seeds` calibration seeds, with coarse values (ties)."""
    rng = np.random.default_rng(rng_seed)
    rows = []
    for method in ("taylor", "blockwise", "random"):
        for sparsity in (0.1, 0.3, 0.5):
            for uniform in (False, True):
                for seed in range(seeds):
                    round_to = 1 if ties else 4
                    rows.append({
                        "trial_id": f"{method}_{sparsity}_{uniform}_{seed}", "model": "m", "seed": seed,
                        "pruning_method": method, "sparsity": sparsity, "uniform": uniform,
                        "acc_mean": round(0.6 - 0.4 * sparsity + rng.normal(0, 0.03), round_to),
                        "acc_mean_stderr": 0.01 + 0.01 * rng.random(),
                        "ppl": float(np.exp(3 + 3 * sparsity + rng.normal(0, 0.2))),
                        "decode_speedup": round(1 + sparsity * (1.5 if uniform else 1) + rng.normal(0, 0.05), round_to),
                        "memory_ratio": 1 - sparsity + rng.normal(0, 0.01),
                    })
    return pd.DataFrame(rows)


def brute_force(df: pd.DataFrame, objectives: list[tuple[str, str]]) -> tuple[set, dict]:
    """Mean per configuration with pandas (geometric for ppl), then every pair compared in Python."""
    agg = {m: (lambda v: float(np.exp(np.log(v).mean()))) if m == "ppl" else "mean" for m, _ in objectives}
    means = df.groupby(DIMS).agg({**agg, "trial_id": "min"}).reset_index()
    front, dominators = set(), {}
    for _, b in means.iterrows():
        beaten_by = []
        for _, a in means.iterrows():
            at_least = all((a[m] >= b[m]) if d == "max" else (a[m] <= b[m]) for m, d in objectives)
            strictly = any((a[m] > b[m]) if d == "max" else (a[m] < b[m]) for m, d in objectives)
            if at_least and strictly:
                beaten_by.append(a["trial_id"])
        dominators[b["trial_id"]] = sorted(beaten_by)
        if not beaten_by:
            front.add(b["trial_id"])
    return front, dominators


OBJECTIVE_SETS = [
    [("acc_mean", "max"), ("decode_speedup", "max")],
    [("ppl", "min"), ("memory_ratio", "min"), ("decode_speedup", "max")],
    [("acc_mean", "max"), ("ppl", "min")],
]


@pytest.mark.parametrize("objectives", OBJECTIVE_SETS, ids=lambda o: "+".join(m for m, _ in o))
@pytest.mark.parametrize("seeds, ties", [(1, True), (3, False)])
def test_the_front_equals_a_brute_force_non_dominated_filter(objectives, seeds, ties):
    df = trials(seeds=seeds, ties=ties)
    table = pareto_front(df, tuple(Objective(m, d) for m, d in objectives))
    front, dominators = brute_force(df, objectives)
    assert set(table.loc[table["on_front"], "point"]) == front
    assert {p: sorted(filter(None, d.split(";"))) for p, d in zip(table["point"], table["dominated_by"])} == dominators
    assert len(table) == 18 and table["seeds"].eq(seeds).all()
    assert table["on_front"].iloc[: len(front)].all()  # the front first, by the first objective
    first, mode = objectives[0]
    on = table[table["on_front"]][first].to_numpy()
    assert (np.diff(on) <= 0).all() if mode == "max" else (np.diff(on) >= 0).all()


def test_each_point_carries_its_uncertainty_seeds_and_items_in_quadrature():
    df = trials(seeds=3, ties=False)
    table = pareto_front(df, (Objective("acc_mean", "max"), Objective("decode_speedup", "max")))
    for _, row in table.iterrows():
        group = df[(df["pruning_method"] == row["pruning_method"]) & (df["sparsity"] == row["sparsity"])
                   & (df["uniform"] == row["uniform"])]
        items = math.sqrt((group["acc_mean_stderr"] ** 2).mean())  # the same items at every seed: no 1/sqrt(n)
        assert row["acc_mean_se"] == pytest.approx(math.hypot(scipy_stats.sem(group["acc_mean"]), items), rel=1e-12)
        assert row["decode_speedup_se"] == pytest.approx(scipy_stats.sem(group["decode_speedup"]), rel=1e-12)
    one = pareto_front(trials(seeds=1), (Objective("ppl", "min"), Objective("decode_speedup", "max")))
    assert one["ppl_se"].isna().all() and one["decode_speedup_se"].isna().all()  # one seed: nothing measured


def test_the_best_under_constraints_matches_a_pandas_query():
    df = trials(seeds=2, ties=False)
    for texts, objective in [(["decode_speedup>=1.3"], Objective("acc_mean", "max")),
                             (["decode_speedup > 1.2", "memory_ratio<0.8"], Objective("ppl", "min")),
                             (["acc_mean>=0.55", "sparsity>=0.3"], Objective("decode_speedup", "max"))]:
        constraints = tuple(parse_constraint(t) for t in texts)
        got = best_under(df, constraints, objective)
        names = [objective.metric, *(c.metric for c in constraints)]
        means = df.groupby(DIMS).agg({**{m: "mean" for m in names if m != "ppl"}, "trial_id": "min",
                                      **({"ppl": lambda v: float(np.exp(np.log(v).mean()))} if "ppl" in names else {})})
        query = " and ".join(f"{c.metric} {c.op} {c.value}" for c in constraints)
        meeting = means.reset_index(drop=True).query(query)
        assert got["satisfying"] == len(meeting) and got["of"] == len(means)
        if meeting.empty:
            assert got["best"] is None
            continue
        expected = meeting.sort_values(objective.metric, ascending=objective.mode == "min").iloc[0]
        assert got["best"]["point"] == expected["trial_id"]
    none = best_under(df, (parse_constraint("decode_speedup>=9"),), Objective("acc_mean", "max"))
    assert none["best"] is None and none["satisfying"] == 0 and "no configuration" in none["reason"]


@pytest.mark.parametrize("text", ["decode_speedup=>1.3", "decode_speedup>=fast", ">=1.3", "decode speedup>=1"])
def test_a_malformed_constraint_names_the_syntax(text):
    with pytest.raises(ValueError, match="METRIC OP NUMBER"):
        parse_constraint(text)


def test_the_report_has_the_front_and_the_constrained_best_and_refuses_an_unknown_metric(tmp_path):
    from tests.report_helpers import write_tune_folder

    df = trials(seeds=1).drop(columns="model")
    df["model"] = "tiny-llama"
    for task in ("piqa",):
        df[f"acc_{task}"], df[f"acc_{task}_stderr"] = df["acc_mean"], df["acc_mean_stderr"]
    df["taylor_seq_len"], df["taylor_num_samples"] = 32, 8
    folder = write_tune_folder(df, tmp_path / "sweep", objective={"metric": "acc_mean", "mode": "max"})
    report = build_report(folder, constraints=("decode_speedup>=1.3",))
    m = report.models["tiny-llama"]
    assert [o.metric for o in m.front_objectives] == ["acc_mean", "decode_speedup"]  # one objective + speed measured
    front, _ = brute_force(df, [("acc_mean", "max"), ("decode_speedup", "max")])
    points = {name: f"abcde_{i:05d}" for i, name in enumerate(df["trial_id"])}  # the ids the folder gives them
    assert set(m.front.loc[m.front["on_front"], "point"]) == {points[p] for p in front}
    assert m.constrained["best"]["decode_speedup"] >= 1.3
    with pytest.raises(ReportError, match="--constraint: constraint speed>=1: 'speed' is not a column"):
        build_report(folder, constraints=("speed>=1",))


@pytest.mark.slow
def test_the_real_front_equals_a_brute_force_filter_of_the_kept_results():
    """experiments/pareto_real.yaml's 50 trials as kept in bench/pareto_real: the report's front and dominators equal
    a brute-force filter of the trials' final results, read here with json and pandas only."""
    import json
    from pathlib import Path

    kept = Path(__file__).resolve().parents[2] / "bench" / "pareto_real"
    finals = []
    for folder in sorted(kept.glob("sweep_trainable_*")):
        lines = [line for line in (folder / "result.json").read_text().splitlines() if line.strip()]
        final = json.loads(lines[-1])
        finals.append({k: final[k] for k in (*DIMS, "ppl", "decode_speedup")} | {"trial_id": final["trial_id"]})
    rows = pd.DataFrame(finals)
    assert len(rows) == 50 and rows.groupby(DIMS).size().eq(1).all()
    front, dominators = brute_force(rows, [("ppl", "min"), ("decode_speedup", "max")])
    m = build_report(kept).models["smollm2-135m"]
    assert [(o.metric, o.mode) for o in m.front_objectives] == [("ppl", "min"), ("decode_speedup", "max")]
    assert set(m.front.loc[m.front["on_front"], "point"]) == front and len(front) >= 5
    assert {p: sorted(filter(None, d.split(";"))) for p, d in zip(m.front["point"], m.front["dominated_by"])} \
        == dominators


def test_each_point_names_its_family_on_the_front_and_in_the_report():
    import pandas as pd

    from taylor_tune.reporting import build_report, render_text
    from taylor_tune.reporting.pareto import pareto_front
    from taylor_tune.reporting.stats import Objective
    from tests.report_helpers import synthetic_trials

    df = synthetic_trials()
    df = df[df["model"] == "model-a"].copy()
    df.loc[df["pruning_method"] == "blockwise", "pruning_method"] = "depth"
    df["decode_speedup"] = [1.0 + 0.01 * i for i in range(len(df))]
    df["depth_share"] = [0.5 if m == "layerwise" else 0.0 for m in df["pruning_method"]]  # mixed cuts
    front = pareto_front(df, (Objective("acc_mean", "max"), Objective("decode_speedup", "max")))
    assert (front["family"] == front["pruning_method"].map({"depth": "depth", "layerwise": "mixed"})
            .fillna("width")).all()
    assert set(front["family"]) == {"depth", "width", "mixed"}
    text = render_text(build_report(pd.DataFrame(df)))
    front_section = text[text.index("Pareto front"):]
    table = front_section[: front_section.index("Dominated")]  # the front's own table names each point's family
    assert "family" in table and "depth" in table


def test_a_dominated_point_within_the_uncertainty_is_named_tied_against_a_loop():
    import math

    import numpy as np
    import pandas as pd

    from taylor_tune.reporting.pareto import pareto_front
    from taylor_tune.reporting.stats import Objective

    rng = np.random.default_rng(7)
    objectives = (Objective("acc_mean", "max"), Objective("decode_speedup", "max"))
    for _ in range(5):
        n = 12
        df = pd.DataFrame({"trial_id": [f"t{i:02d}" for i in range(n)], "model": "m",
                           "pruning_method": [f"m{i}" for i in range(n)], "seed": 0,
                           "acc_mean": rng.uniform(0.4, 0.5, n).round(2), "acc_mean_stderr": rng.uniform(0, 0.02, n),
                           "decode_speedup": rng.uniform(1.0, 1.5, n).round(1),
                           "decode_speedup_se": rng.uniform(0, 0.1, n)})
        front = pareto_front(df, objectives).set_index("point")
        rows = df.set_index("trial_id")
        tied_somewhere = 0
        for j in rows.index:
            expected = []
            for i in rows.index:
                a, b = rows.loc[i], rows.loc[j]
                ge = all(a[m] >= b[m] for m in ("acc_mean", "decode_speedup"))
                gt = any(a[m] > b[m] for m in ("acc_mean", "decode_speedup"))
                within = all(a[m] - b[m] <= 1.959964 * math.hypot(a[se], b[se])
                             for m, se in (("acc_mean", "acc_mean_stderr"), ("decode_speedup", "decode_speedup_se")))
                if ge and gt and within:
                    expected.append(i)
            tied_somewhere += bool(expected)
            got = front.loc[j, "tied_with"]
            assert (sorted(got.split(";")) if got else []) == sorted(expected), (j, got, expected)
            assert set(expected) <= set(front.loc[j, "dominated_by"].split(";") if front.loc[j, "dominated_by"]
                                        else [])
        assert tied_somewhere  # the draw has ties to find


def test_a_front_of_no_trials_has_a_fronts_columns_and_filters_like_one():
    # front[front["on_front"]] must select rows on an empty front too: an object column would select columns instead
    objectives = (Objective("acc_mean", "max"), Objective("ppl", "min"))
    df = trials()
    full, empty = pareto_front(df, objectives), pareto_front(df.iloc[:0], objectives)
    assert {"on_front", "dominated_by", "tied_with"} <= set(empty.columns) and empty.attrs["left_out"] == 0
    assert empty["on_front"].dtype == full["on_front"].dtype == bool
    assert list(empty[empty["on_front"]].columns) == list(empty.columns)
    assert list(full[full["on_front"]].columns) == list(full.columns)


def test_each_point_of_the_front_figure_is_marked_with_its_own_layout():
    """The figure's data once called an aligned or servable point "free" (only `uniform` was read): each point's
    layout is the one its configuration's settings make, written out by hand here."""
    from taylor_tune.reporting import plots

    layouts = {False: "free", True: "uniform"}
    df = trials(seeds=1)
    df["align"], df["servable"] = np.nan, False
    for i in df.index[::4]:  # some free configurations aligned, some servable (one with a larger multiple of 256)
        if not df.at[i, "uniform"]:
            df.at[i, "align"] = (64, 128, 512)[i % 3]
            df.at[i, "servable"] = i % 3 == 2
    expected = {row.trial_id: ("servable" if row.servable else f"align {int(row.align)}" if row.align == row.align
                               else layouts[row.uniform]) for row in df.itertuples()}
    assert {"free", "uniform", "servable", "align 64"} <= set(expected.values())
    objectives = (Objective("acc_mean", "max"), Objective("decode_speedup", "max"))
    front = pareto_front(df, objectives)
    data = plots.pareto_data(front, "m", objectives)
    assert sum(map(len, data.labels)) == len(df)
    for k, points in enumerate(data.points):
        assert data.labels[k] == [expected[p] for p in points]
