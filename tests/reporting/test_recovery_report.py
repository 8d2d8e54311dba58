"""The report's recovery section against independent computations: the held-out perplexities are exp of the mean
losses recomputed by hand per configuration, Kendall's tau-b is the brute-force count of concordant and discordant
pairs, the best configurations are the minima by hand, and the files carry the same numbers."""

import itertools
import json
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from taylor_tune.reporting import build_report, render_text, write_report
from taylor_tune.reporting.stats import kendall_tau, recovery_comparison
from tests.report_helpers import synthetic_trials


def recovered(table: pd.DataFrame, seed: int = 1) -> pd.DataFrame:
    """The synthetic trials recovered twice (ce and kd): a held-out loss before (of the pruning alone, the same for
    both losses) and after, with ranks shuffled a little by recovery."""
    rng = np.random.default_rng(seed)
    rows = []
    for row in table.to_dict(orient="records"):
        before = 3.0 + rng.uniform(0, 1)
        for loss, gain in (("ce", 0.2), ("kd", 0.3)):
            rows.append(row | {"trial_id": f"{row['trial_id']}_{loss}", "recovery_loss": loss, "lora_rank": 8,
                               "recovery_steps": 50, "recovery_heldout_loss_before": before,
                               "recovery_heldout_loss_after": before - gain + rng.normal(0, 0.15)})
    return pd.DataFrame(rows)


def tau_by_hand(x, y) -> float:
    """tau-a from the pairs (equal to tau-b without ties)."""
    pairs = list(itertools.combinations(range(len(x)), 2))
    signs = [np.sign(x[i] - x[j]) * np.sign(y[i] - y[j]) for i, j in pairs]
    return sum(signs) / len(pairs)


def test_kendall_tau_is_the_pair_count_and_its_interval_holds_it():
    rng = np.random.default_rng(3)
    for n in (3, 5, 12):
        x = rng.permutation(n).astype(float)
        y = x + rng.normal(0, n / 3, n)
        got = kendall_tau(x, y, draws=300, seed=0)
        assert got["tau"] == pytest.approx(tau_by_hand(x, y), abs=1e-12)
        assert got["configurations"] == n
        assert -1 <= got["ci95"][0] <= got["ci95"][1] <= 1
    same = kendall_tau([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0], draws=200)
    assert same["tau"] == 1.0 and same["ci95"] == [1.0, 1.0]
    reversed_ = kendall_tau([1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0], draws=200)
    assert reversed_["tau"] == -1.0


def test_recovery_comparison_equals_a_recomputation_by_hand():
    df = recovered(synthetic_trials(seeds=(0, 1)))
    model = df[df["model"] == "model-a"]
    got = recovery_comparison(model)
    table = got["table"]
    pruning = ["pruning_method", "taylor_seq_len", "taylor_num_samples"]
    assert list(table.columns[:4]) == ["recovery_loss", *pruning]  # only what tells configurations apart
    assert len(table) == 2 * 3 * 5 * 3
    for loss in ("ce", "kd"):
        rows = model[model["recovery_loss"] == loss]
        mine = table[table["recovery_loss"] == loss]
        # by hand: each trial's held-out perplexity, averaged over the seeds of its configuration
        exact = rows.assign(b=np.exp(rows["recovery_heldout_loss_before"]),
                            a=np.exp(rows["recovery_heldout_loss_after"]))
        exact = exact.groupby(pruning)[["b", "a", "acc_mean"]].mean().add_prefix("hand_")
        merged = mine.set_index(pruning).join(exact)
        merged = merged.rename(columns={"hand_b": "b", "hand_a": "a"})
        assert np.allclose(merged["heldout_ppl_before"], merged["b"], rtol=1e-12)
        assert np.allclose(merged["heldout_ppl_after"], merged["a"], rtol=1e-12)
        assert np.allclose(merged["acc_mean"], merged["hand_acc_mean"], rtol=1e-12)  # the objective, after
        assert np.allclose(merged["change"], merged["a"] / merged["b"] - 1, rtol=1e-12)
        (ranking,) = [r for r in got["rankings"] if r["recovery"]["recovery_loss"] == loss]
        assert ranking["configurations"] == 45
        assert ranking["tau"] == pytest.approx(tau_by_hand(merged["b"].to_numpy(), merged["a"].to_numpy()), abs=1e-12)
        name = lambda key: f"pruning_method={key[0]}, taylor_seq_len={key[1]}, taylor_num_samples={key[2]}"
        assert ranking["best_before"] == name(merged["b"].idxmin())
        assert ranking["best_after"] == name(merged["a"].idxmin())
        assert ranking["same_best"] == (merged["b"].idxmin() == merged["a"].idxmin())
        assert ranking["recovery"] == {"recovery_loss": loss, "recovery_steps": 50, "lora_rank": 8}
    assert recovery_comparison(synthetic_trials()) is None  # no trial recovered: no section


def test_the_report_says_it_and_writes_it(tmp_path):
    df = recovered(synthetic_trials())
    report = build_report(df, model="model-a")  # one model: the section is per model, and fANOVA is most of the time
    text = render_text(report)
    assert "12. Recovery: before and after" in text
    m = report.models["model-a"]
    for r in m.recovery["rankings"]:
        assert f"recovery_loss={r['recovery']['recovery_loss']}: Kendall's tau-b {r['tau']:.3f}" in text
    written = write_report(report, tmp_path / "out")
    folder = tmp_path / "out" / "consolidated_model-a"
    assert folder / "recovery_comparison.csv" in written
    csv = pd.read_csv(folder / "recovery_comparison.csv")
    assert np.allclose(csv["heldout_ppl_after"], m.recovery["table"]["heldout_ppl_after"])
    assert json.loads((folder / "recovery_rankings.json").read_text())[0]["tau"] == m.recovery["rankings"][0]["tau"]


def test_with_the_pruned_model_evaluated_before_the_ranking_on_the_metric_and_the_front_carry_it():
    from taylor_tune.reporting import pareto, plots
    from taylor_tune.reporting.stats import ACCURACY, Objective

    df = recovered(synthetic_trials(seeds=(0, 1)))
    rng = np.random.default_rng(5)
    df["before_recovery_acc_mean"] = df["acc_mean"] - rng.uniform(0.01, 0.05, len(df))
    df["decode_speedup"] = 1.0 + df["taylor_seq_len"] / 1000
    model = df[(df["model"] == "model-a") & (df["recovery_loss"] == "kd")]
    got = recovery_comparison(model, ACCURACY)
    (ranking,) = got["rankings"]
    pruning = ["pruning_method", "taylor_seq_len", "taylor_num_samples"]
    hand = model.groupby(pruning)[["before_recovery_acc_mean", "acc_mean"]].mean()
    on = ranking["on_metric"]
    assert on["metric"] == "acc_mean"
    assert on["tau"] == pytest.approx(tau_by_hand(hand["before_recovery_acc_mean"].to_numpy(),
                                                  hand["acc_mean"].to_numpy()), abs=1e-12)
    name = lambda key: f"pruning_method={key[0]}, taylor_seq_len={key[1]}, taylor_num_samples={key[2]}"
    assert on["best_before"] == name(hand["before_recovery_acc_mean"].idxmax())  # accuracy: the highest
    assert on["best_after"] == name(hand["acc_mean"].idxmax())
    table = got["table"].set_index(pruning)
    assert np.allclose(table.loc[hand.index, "before_recovery_acc_mean"], hand["before_recovery_acc_mean"])
    # the front after recovery, each configuration's point before it beside (its speed unchanged)
    front = pareto.pareto_front(model, (ACCURACY, Objective("decode_speedup", "max")))
    by_point = front.set_index("point")
    for point, row in by_point.iterrows():
        trials = model[model["trial_id"].isin(row["trials"].split(";"))]
        assert row["before_recovery_acc_mean"] == pytest.approx(trials["before_recovery_acc_mean"].mean(), abs=1e-12)
    data = plots.pareto_data(front, "model-a", (ACCURACY, Objective("decode_speedup", "max")))
    for k, method in enumerate(data.methods):
        rows = front[front["pruning_method"] == method]
        assert data.before_y[k] == pytest.approx(list(rows["before_recovery_acc_mean"]))
        assert data.before_x[k] == pytest.approx(list(rows["decode_speedup"]))
    plots.render_pareto(data, Path(tempfile.mkdtemp()) / "front.png")
    text = render_text(build_report(model))
    assert "on acc_mean (evaluated before and after): Kendall's tau-b" in text
    plain = pareto.pareto_front(synthetic_trials(), (ACCURACY, Objective("ppl", "min")))
    assert not any(c.startswith("before_recovery_") for c in plain)
    assert plots.pareto_data(plain, "model-a", (ACCURACY, Objective("ppl", "min"))).before_y == []


def measured_before(configurations: int, seed: int = 0) -> pd.DataFrame:
    """Recovered trials that were also evaluated before recovery (recovery.evaluate_before): `configurations`
    pruning configurations x two seeds, one recovery setting."""
    rng = np.random.default_rng(seed)
    rows = []
    for c in range(configurations):
        for s in range(2):
            rows.append({"trial_id": f"c{c}s{s}", "pruning_method": "taylor", "sparsity": 0.1 * (c + 1), "seed": s,
                         "recovery_loss": "ce", "recovery_heldout_loss_before": 3 + rng.uniform(0, 1),
                         "recovery_heldout_loss_after": 2.5 + rng.uniform(0, 1),
                         "before_recovery_acc_mean": rng.uniform(0.3, 0.5), "acc_mean": rng.uniform(0.3, 0.5),
                         "before_recovery_ppl": rng.uniform(20, 60), "ppl": rng.uniform(15, 50)})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("configurations, metric, mode", [(2, "acc_mean", "max"), (2, "ppl", "min"),
                                                          (3, "acc_mean", "max"), (3, "ppl", "min"),
                                                          (12, "acc_mean", "max")])  # 12: intervals differ by seed
def test_the_ranking_on_the_sweeps_metric_before_and_after_equals_a_loop(configurations, metric, mode):
    from taylor_tune.reporting.stats import Objective

    df = measured_before(configurations, seed=configurations)
    (got,) = recovery_comparison(df, Objective(metric, mode), seed=3)["rankings"]
    means = df.groupby("sparsity")[[f"before_recovery_{metric}", metric]].mean()  # one row per configuration
    pick = (lambda s: s.idxmax()) if mode == "max" else (lambda s: s.idxmin())
    name = lambda sparsity: f"sparsity={sparsity}"
    assert got["configurations"] == configurations and got["recovery"] == {"recovery_loss": "ce"}
    on = got["on_metric"]
    assert on["metric"] == metric
    assert on["best_before"] == name(pick(means[f"before_recovery_{metric}"])) and on["best_after"] == name(
        pick(means[metric]))
    assert on["same_best"] == (pick(means[f"before_recovery_{metric}"]) == pick(means[metric]))
    if configurations >= 3:  # the rank agreement, with the caller's bootstrap seed
        want = kendall_tau(means[f"before_recovery_{metric}"].to_numpy(), means[metric].to_numpy(), seed=3)
        assert {k: on[k] for k in ("tau", "ci95", "configurations")} == want
    else:
        assert "tau" not in on and got["reason"].startswith("fewer than three configurations")
