"""Statistics over a table of valid trials: pure functions (pandas / scipy / Optuna), no files, no plots.

Every function takes the DataFrame of one model's valid trials (or all models' for the cross-model ones)
and returns plain data. Where a statistic cannot be computed it says why instead of returning nan.

Correlation strength words, by |r|: below 0.3 "negligible", 0.3 to 0.5 "weak", 0.5 to 0.7 "moderate",
0.7 and above "strong" (the source tools' boundaries). The p-value (scipy's two-sided Pearson test) and the
number of rows used are always printed beside the words.

Uncertainty: lm-eval gives each task's accuracy a standard error; acc_mean's is sqrt(sum se_t^2) / T
(tasks are disjoint item sets, so their errors are independent). Two trials differ beyond their uncertainty
when the difference exceeds z * sqrt(se_a^2 + se_b^2), z = 1.96 by default. Both trials answer the same
items, so this independent-errors bound is conservative: where both kept their items' outcomes, the lead of the best
is judged paired instead (`taylor_tune.paired`: the task-stratified standard error of the per-item differences).
A single task's interval is Wilson's over its item count (`acc_<task>_n`) where the trials record it.

Ranking follows the sweep's `Objective` (its `metric` and `mode`, acc_mean / max unless the experiment said
otherwise): the best trial, the best method and value, correlations, fANOVA and the value of a search all use
it; the stderr-based lead and the held-out selection exist only for accuracies (a perplexity has no stderr here).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd
from scipy import stats

from taylor_tune.config import layout_name
from taylor_tune.paired import mcnemar, paired_difference, paired_log_ppl, shared
from taylor_tune.schema import (
    BEFORE_RECOVERY,
    CONFIG_COLUMNS,
    CRITERION_METHODS,
    RECOVERY_DIMENSIONS,
    SEARCHABLE,
    SPEED_METRICS,
    before_recovery_key,
)

Z95 = float(stats.norm.ppf(0.975))
CONFIG = CONFIG_COLUMNS[1:4]  # pruning_method, taylor_seq_len, taylor_num_samples
STRENGTHS = ((0.7, "strong"), (0.5, "moderate"), (0.3, "weak"), (0.0, "negligible"))


def multiplicative(metric: str) -> bool:
    """A perplexity: its spread is multiplicative (one method at 900 beside others at 50), so it is averaged and
    varied in log space: geometric means, log-scale plots, fANOVA of its log."""
    return metric.removeprefix(BEFORE_RECOVERY) == "ppl"


@dataclass(frozen=True)
class Objective:
    """What the sweep optimized: `metric` (acc_mean, ppl or acc_<task>) and `mode` (max or min)."""

    metric: str = "acc_mean"
    mode: str = "max"

    @property
    def ascending(self) -> bool:
        """Sort order that puts the best first."""
        return self.mode == "min"

    @property
    def center(self) -> str:
        """The summary column that ranks groups: the geometric mean of a perplexity (an arithmetic mean over
        methods is the worst method's number: one blockwise trial at ppl 911 outweighs ten near 50), else the mean."""
        return "gmean" if multiplicative(self.metric) else "mean"

    def best_index(self, values: pd.Series):
        return values.idxmin() if self.ascending else values.idxmax()

    def loss(self, best: float, value: float) -> float:
        """How much worse `value` is than `best`, positive when worse, in the metric's units."""
        return value - best if self.ascending else best - value


ACCURACY = Objective()


def strength(r: float) -> str:
    words = next(word for bound, word in STRENGTHS if abs(r) >= bound)
    return words if words == "negligible" else f"{words} {'positive' if r > 0 else 'negative'}"


@dataclass
class Correlation:
    """Pearson r of `x` with `y` over the rows where both are finite; r is None when undefined (`reason`)."""

    x: str
    y: str
    n: int
    r: float | None = None
    p: float | None = None
    strength: str | None = None
    reason: str | None = None
    excluded: dict = field(default_factory=dict)  # rows left out, by why: {"inf": 3, "missing": 1}

    def describe(self) -> str:
        left_out = ", ".join(f"{k} {v}" for k, v in self.excluded.items() if v)
        left_out = f"; left out: {left_out}" if left_out else ""
        if self.r is None:
            return f"undefined: {self.reason} (n = {self.n}{left_out})"
        return f"r = {self.r:+.3f} ({self.strength}, p = {self.p:.3g}, n = {self.n}{left_out})"

    def to_dict(self) -> dict:
        return asdict(self)


def correlation(df: pd.DataFrame, x: str, y: str = "acc_mean", min_rows: int = 3) -> Correlation:
    if x not in df or y not in df:
        missing = x if x not in df else y
        return Correlation(x, y, 0, reason=f"column {missing} is absent")
    a = pd.to_numeric(df[x], errors="coerce").to_numpy(dtype=float)
    b = pd.to_numeric(df[y], errors="coerce").to_numpy(dtype=float)
    inf = np.isinf(a) | np.isinf(b)
    missing = (np.isnan(a) | np.isnan(b)) & ~inf
    keep = np.isfinite(a) & np.isfinite(b)
    excluded = {"inf": int(inf.sum()), "missing": int(missing.sum())}
    n = int(keep.sum())
    result = Correlation(x, y, n, excluded=excluded)
    if n < min_rows:
        result.reason = f"only {n} rows with finite {x} and {y} (needs {min_rows})"
    elif np.ptp(a[keep]) == 0:
        result.reason = f"{x} is constant ({a[keep][0]:g}) over these rows"
    elif np.ptp(b[keep]) == 0:
        result.reason = f"{y} is constant ({b[keep][0]:g}) over these rows"
    else:
        test = stats.pearsonr(a[keep], b[keep])
        result.r, result.p = float(test.statistic), float(test.pvalue)
        result.strength = strength(result.r)
    return result


def geometric_mean(values) -> float:
    """exp(mean(log(values))), or the value itself when all are equal: exp(log(30.0)) is 30.000000000000004, and a
    group of equal perplexities must still meet ppl<=30 (NaN for no values)."""
    values = np.asarray(values, dtype=float)
    if values.size == 0:
        return math.nan
    return float(values[0]) if np.ptp(values) == 0 else float(np.exp(np.mean(np.log(values))))


def summary(df: pd.DataFrame, by: str, metric: str = "acc_mean") -> pd.DataFrame:
    """mean, std (n-1), min, max and count of `metric` per value of `by`, sorted by that value; for ppl also its
    geometric mean (`gmean`, first)."""
    table = df.groupby(by)[metric].agg(["mean", "std", "min", "max", "count"])
    if multiplicative(metric):
        table.insert(0, "gmean", df[metric].astype(float).groupby(df[by]).agg(geometric_mean))
    return table.sort_index()


def best_trial(df: pd.DataFrame, objective: Objective = ACCURACY) -> pd.Series | None:
    """The trial with the best objective metric; ties go to the lower ppl (ranking by an accuracy) or the higher
    acc_mean (ranking by ppl), then the smaller trial id."""
    if df.empty:
        return None
    value = pd.to_numeric(df[objective.metric], errors="coerce")
    if objective.metric == "ppl":
        tie = -pd.to_numeric(df["acc_mean"], errors="coerce").fillna(-np.inf) if "acc_mean" in df else 0.0
    else:
        tie = df["ppl"].fillna(np.inf) if "ppl" in df else np.inf
    ordered = df.assign(_value=value if objective.ascending else -value, _tie=tie)
    ordered = ordered.sort_values(["_value", "_tie", "trial_id"], kind="stable")
    return ordered.iloc[0].drop(["_value", "_tie"])


def method_labels(df: pd.DataFrame) -> pd.Series:
    """Each trial's method as the comparison names it: pruning_method, with `+criterion` where the method ranks by a
    criterion other than taylor (taylor+flap, layerwise+wanda_sp, blockwise+l1), and the experts method always with
    its expert criterion (experts+reap, experts+frequency), so that the criteria compare apart."""
    labels = df["pruning_method"]
    if "criterion" in df:
        criterion = df["criterion"].astype(object)
        other = df["pruning_method"].isin(CRITERION_METHODS) & criterion.notna() & (criterion != "taylor")
        labels = labels.where(~other, df["pruning_method"].astype(str) + "+" + criterion.astype(str))
    if "expert_criterion" in df:
        criterion = df["expert_criterion"].astype(object)
        experts = (df["pruning_method"] == "experts") & criterion.notna()
        labels = labels.where(~experts, "experts+" + criterion.astype(str))
    return labels


def method_comparison(df: pd.DataFrame, objective: Objective = ACCURACY) -> dict:
    """Per method (method_labels: the baselines' criteria apart): statistics of the objective metric; the best method
    is the best trial's (as the source tools chose), and the method with the best mean is named beside it.
    `best_acc` is the best trial's acc_mean."""
    if not df.empty:
        df = df.assign(pruning_method=method_labels(df))
    table = summary(df, "pruning_method", objective.metric)
    best = best_trial(df, objective)
    return {
        "table": table,
        "best_method": None if best is None else best["pruning_method"],
        "best_acc": None if best is None else plain(float(best["acc_mean"])),
        "best_value": None if best is None else float(best[objective.metric]),
        "best_method_by_mean": None if table.empty else objective.best_index(table[objective.center]),
    }


def paired_levels(df: pd.DataFrame, column: str, best_level, outcomes: dict, z: float = Z95,
                  labels: pd.Series | None = None) -> pd.DataFrame | None:
    """Each other level of `column` (or of `labels`, e.g. `method_labels`) against `best_level` in acc_mean, paired
    by configuration: a trial is paired with the best level's trial whose other settings (every other searched
    column and the seed) are the same, where both kept their items' outcomes on the same items. Per item, the mean
    outcome over a level's paired trials; the difference and its task-stratified error by `paired.
    paired_difference` (items as the units). One row per level with a pair: level, pairs, difference (level minus
    best), stderr, separated (|difference| > z stderr). None where no level pairs."""
    if df.empty or not outcomes:
        return None
    varied = {column} if labels is None else {column, "pruning_method", "criterion", "expert_criterion"}  # a label's
    labels = df[column] if labels is None else labels
    keys = [c for c in (*searched(df), "seed") if c in df and c not in varied]
    key = df[keys].map(repr).agg("|".join, axis=1) if keys else pd.Series("", index=df.index)  # None, NaN too
    best = {key[i]: df.at[i, "trial_id"] for i in df.index[labels == best_level] if df.at[i, "trial_id"] in outcomes}
    rows = []
    for level in labels[labels != best_level].dropna().unique():
        ours, theirs = [], []
        for i in df.index[labels == level]:
            mine, match = df.at[i, "trial_id"], best.get(key[i])
            if match is None or mine not in outcomes or shared(outcomes[mine], outcomes[match]) is None:
                continue
            if ours and not outcomes[mine].index.sort_values().equals(ours[0].index.sort_values()):
                continue  # another fidelity's items: pairs are averaged over the same items only
            ours.append(outcomes[mine])
            theirs.append(outcomes[match])
        if not ours:
            continue
        pair = paired_difference(pd.concat(ours, axis=1).mean(axis=1), pd.concat(theirs, axis=1).mean(axis=1))
        rows.append({"level": level, "pairs": len(ours), "difference": pair.difference, "stderr": pair.stderr,
                     "separated": pair.separated(z)})
    return pd.DataFrame(rows) if rows else None


def hyperparameter_impact(df: pd.DataFrame, param: str, objective: Objective = ACCURACY) -> dict:
    """Statistics of the objective metric per value of `param`; the best value is the one with the best mean."""
    table = summary(df, param, objective.metric)
    center = table[objective.center] if not table.empty else None
    return {"table": table, "best_value": None if table.empty else objective.best_index(center),
            "best_mean": None if table.empty else float(center.loc[objective.best_index(center)])}


def extreme_layers(df: pd.DataFrame, objective: Objective = ACCURACY) -> dict:
    table = df.groupby("extreme_pruning_layers")[objective.metric].agg(["mean", "count"]).sort_index()
    return {"correlation": correlation(df, "extreme_pruning_layers", objective.metric), "table": table}


def acc_mean_stderr(df: pd.DataFrame, tasks: tuple[str, ...]) -> pd.Series:
    """Standard error of each trial's acc_mean from its tasks' stderrs (NaN where one is missing)."""
    columns = [f"acc_{t}_stderr" for t in tasks]
    if not tasks or any(c not in df for c in columns):
        return pd.Series(np.nan, index=df.index)
    se = df[columns].apply(pd.to_numeric, errors="coerce")
    return np.sqrt((se**2).sum(axis=1, min_count=len(columns))) / len(columns)


def confidence_interval(value: float, stderr: float, z: float = Z95) -> tuple[float, float] | None:
    """Normal-approximation interval value ± z * stderr, clipped to [0, 1] (these are accuracies)."""
    if stderr is None or not math.isfinite(stderr):
        return None
    return (max(0.0, value - z * stderr), min(1.0, value + z * stderr))


def wilson_interval(accuracy: float, n: int, z: float = Z95) -> tuple[float, float] | None:
    """Wilson score interval of a task's accuracy over n items: unlike accuracy ± z * stderr it stays honest at
    0 and 1, where the binomial stderr lm-eval reports is 0 (40 of 40 right is not certainty)."""
    if n is None or not n > 0 or accuracy is None or not math.isfinite(accuracy):
        return None
    centre = (accuracy + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(accuracy * (1 - accuracy) / n + z * z / (4 * n * n))
    return (max(0.0, centre - half), min(1.0, centre + half))


def coverage(z: float) -> float:
    return float(2 * stats.norm.cdf(z) - 1)


@dataclass
class Lead:
    """Whether the best trial's lead over the runner-up exceeds its uncertainty, and who is tied with the best."""

    best: str | None
    runner_up: str | None = None
    difference: float | None = None
    stderr: float | None = None
    z: float = Z95
    exceeds_uncertainty: bool | None = None
    tied_with_best: list[str] = field(default_factory=list)  # trial ids whose gap to the best is within z * se
    reason: str | None = None
    paired: int = 0  # trials compared with the best on the same items (the others by the independent bound)
    separated_by_pairing: int = 0  # of those, the ones the independent bound calls tied and the paired test does not
    unit: str = ""  # what `difference` and `stderr` are in when not the metric's own units ("log ppl")

    def to_dict(self) -> dict:
        return asdict(self)


def lead_of_best(df: pd.DataFrame, tasks: tuple[str, ...], z: float = Z95, objective: Objective = ACCURACY,
                 outcomes: dict | None = None, windows: dict | None = None) -> Lead:
    """The best trial's lead over the runner-up and who is tied with it. `outcomes` (trial_id -> each item's score,
    `frame.scored_items`): a trial that scored the same items as the best compares paired (`paired.
    paired_difference`, task-stratified); the others, and every trial without outcomes, by the independent bound.
    Ranked by perplexity, `windows` (trial_id -> its perplexity windows, `frame.read_ppl_windows`): a trial that
    scored the best's windows compares paired in log ppl (`paired.paired_log_ppl`); perplexity has no independent
    bound, so the others are not judged."""
    best = best_trial(df, objective)
    if best is None:
        return Lead(None, reason="no valid trials")
    if len(df) < 2:
        return Lead(best["trial_id"], reason="only one valid trial: nothing to compare with")
    if objective.metric == "ppl" and windows and best["trial_id"] in windows:
        return _ppl_lead(df, best, objective, z, windows)
    if objective.metric != "acc_mean":
        runner = best_trial(df[df["trial_id"] != best["trial_id"]], objective)
        return Lead(
            best["trial_id"],
            runner["trial_id"],
            float(objective.loss(best[objective.metric], runner[objective.metric])),
            z=z,
            reason=f"{objective.metric} has no standard error here; "
            "the calibration-seed spread (search.repeats > 1) is its noise",
        )
    se = acc_mean_stderr(df, tasks)
    others = df[df["trial_id"] != best["trial_id"]]
    runner = best_trial(others)
    lead = Lead(best["trial_id"], runner["trial_id"], float(best["acc_mean"] - runner["acc_mean"]), z=z)
    se_best = se[df["trial_id"] == best["trial_id"]].iloc[0]
    if not math.isfinite(se_best) or se[others.index].isna().any():
        lead.reason = "a task stderr is missing, so the uncertainty is unknown"
        return lead
    gap_se = np.sqrt(se_best**2 + se[others.index] ** 2)
    gap = best["acc_mean"] - others["acc_mean"]
    independent_tie = gap <= z * gap_se
    outcomes = outcomes or {}
    for index, trial_id in others["trial_id"].items():
        pair = (paired_difference(outcomes[best["trial_id"]], outcomes[trial_id])
                if best["trial_id"] in outcomes and trial_id in outcomes else None)
        if pair is not None:
            gap_se[index], gap[index] = pair.stderr, pair.difference
            lead.paired += 1
    lead.stderr = float(gap_se[runner.name])
    lead.exceeds_uncertainty = bool(lead.difference > z * lead.stderr)
    tie = gap <= z * gap_se
    lead.separated_by_pairing = int((independent_tie & ~tie).sum())
    tied = others[tie]
    lead.tied_with_best = tied.sort_values("acc_mean", ascending=False)["trial_id"].tolist()
    return lead


def task_tests(lead: Lead, outcomes: dict) -> dict:
    """Per task, the exact McNemar test of the best against the runner-up on the items both scored (`paired.mcnemar`:
    the discordant counts and the two-sided p); empty where either kept no outcomes, None for a task not paired."""
    if lead.runner_up is None or lead.best not in outcomes or lead.runner_up not in outcomes:
        return {}
    best, runner = outcomes[lead.best], outcomes[lead.runner_up]
    tasks = sorted(set(best.index.get_level_values(0)) | set(runner.index.get_level_values(0)))
    return {task: mcnemar(_task_items(best, task), _task_items(runner, task)) for task in tasks}


def _task_items(items: pd.Series, task: str) -> pd.Series:
    return items[items.index.get_level_values(0) == task]


def _ppl_lead(df: pd.DataFrame, best: pd.Series, objective: Objective, z: float, windows: dict) -> Lead:
    """The lead in log ppl over the runner-up and the ties, each other trial paired with the best on their windows."""
    others = df[df["trial_id"] != best["trial_id"]]
    runner = best_trial(others, objective)
    lead = Lead(best["trial_id"], runner["trial_id"], float(objective.loss(best["ppl"], runner["ppl"])), z=z,
                reason="the runner-up did not score the best's perplexity windows")
    tied = []
    for trial_id in others.sort_values("ppl")["trial_id"]:
        pair = paired_log_ppl(windows[trial_id], windows[best["trial_id"]]) if trial_id in windows else None
        if pair is None:
            continue
        lead.paired += 1
        if not pair.difference > z * pair.stderr:
            tied.append(trial_id)
        if trial_id == runner["trial_id"]:
            lead.difference, lead.stderr, lead.unit, lead.reason = pair.difference, pair.stderr, "log ppl", None
            lead.exceeds_uncertainty = bool(pair.difference > z * pair.stderr)
    lead.tied_with_best = tied
    return lead


def seed_spread(df: pd.DataFrame, objective: Objective = ACCURACY) -> dict:
    """With calibration-seed repeats: the objective metric across seeds for each configuration."""
    if "seed" not in df or df.empty:
        return {"table": None, "reason": "no seed column"}
    table = df.groupby(searched(df), dropna=False)[objective.metric].agg(["mean", "std", "min", "max", "count"])
    table = table[table["count"] > 1]
    if table.empty:
        return {
            "table": None,
            "reason": "one calibration seed per configuration (set search.repeats > 1 to measure the spread)",
        }
    return {"table": table, "reason": None, "mean_std": float(table["std"].mean())}


def heldout_selection(df: pd.DataFrame, tasks: tuple[str, ...]) -> dict:
    """Choose the best configuration on one half of each task's items (`acc_<task>_sel`), report it on the
    other half (`acc_<task>_heldout`): an estimate free of the winner's curse that picking by the same
    numbers one reports carries."""
    sel, held = [f"acc_{t}_sel" for t in tasks], [f"acc_{t}_heldout" for t in tasks]
    if df.empty or not tasks:
        return {"reason": "no valid trials"}
    if any(c not in df for c in sel + held) or df[sel + held].isna().any().any():
        return {"reason": "the trials did not record per-half accuracies (acc_<task>_sel / _heldout)"}
    scores = pd.DataFrame({"sel": df[sel].mean(axis=1), "heldout": df[held].mean(axis=1)}, index=df.index)
    chosen = df.loc[scores.sort_values("sel", ascending=False, kind="stable").index[0]]
    return {
        "reason": None,
        "chosen": chosen["trial_id"],
        "config": {k: plain(chosen[k]) for k in searched(df)},
        "selection_acc": float(scores.loc[chosen.name, "sel"]),
        "heldout_acc": float(scores.loc[chosen.name, "heldout"]),
        "optimism": float(scores.loc[chosen.name, "sel"] - scores.loc[chosen.name, "heldout"]),
        "best_heldout_acc": float(scores["heldout"].max()),
    }


def searched(df: pd.DataFrame) -> list[str]:
    """The configuration's columns: every search dimension the table has (trials that differ only in them are
    the same configuration at another calibration seed)."""
    return list(dict.fromkeys(c for c in (*CONFIG, *SEARCHABLE) if c in df))  # the source tables' three first


def kendall_tau(before, after, draws: int = 2000, seed: int = 0) -> dict:
    """Kendall's tau-b between two rankings of the same configurations (scipy), with a percentile bootstrap
    interval over the configurations (resampled in pairs; a resample with fewer than three distinct ones, or an
    undefined tau, is skipped)."""
    x, y = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    tau = float(stats.kendalltau(x, y).statistic)
    picks = np.random.default_rng(seed).integers(0, len(x), (draws, len(x)))
    taus = _tau_b_rows(x[picks], y[picks])
    taus = taus[(_distinct_per_row(picks) > 2) & np.isfinite(taus)]
    low, high = np.percentile(taus, [2.5, 97.5]) if len(taus) else (math.nan, math.nan)
    return {"tau": tau, "ci95": [float(low), float(high)], "configurations": len(x)}


def _tau_b_rows(x: np.ndarray, y: np.ndarray, cells: int = 1 << 22) -> np.ndarray:
    """Kendall's tau-b of each row pair at once (the bootstrap's thousands of resamples, where one scipy call per
    resample was most of a report's time): (concordant - discordant) / sqrt(pairs untied in x * pairs untied in y),
    over the pairs i < j; nan where either is constant. In blocks of rows, so no sign matrix exceeds `cells`."""
    n = x.shape[1]
    out = np.full(len(x), math.nan)
    step = max(1, cells // max(1, n * n))
    for start in range(0, len(x), step):
        sx = np.sign(x[start:start + step, :, None] - x[start:start + step, None, :])
        sy = np.sign(y[start:start + step, :, None] - y[start:start + step, None, :])
        untied = np.count_nonzero(sx, axis=(1, 2)) * np.count_nonzero(sy, axis=(1, 2)) / 4.0
        with np.errstate(invalid="ignore", divide="ignore"):
            out[start:start + step] = np.clip((sx * sy).sum(axis=(1, 2)) / 2.0 / np.sqrt(untied), -1.0, 1.0)
    return out


def _distinct_per_row(picks: np.ndarray) -> np.ndarray:
    """How many distinct values each row holds."""
    ordered = np.sort(picks, axis=1)
    return 1 + np.count_nonzero(np.diff(ordered, axis=1), axis=1) if ordered.shape[1] else np.zeros(len(picks), int)


BEFORE, AFTER = "recovery_heldout_loss_before", "recovery_heldout_loss_after"


def recovery_comparison(df: pd.DataFrame, objective: Objective = ACCURACY, seed: int = 0) -> dict | None:
    """What recovery changed, per pruning configuration: the held-out perplexity (the recovery's own held-out
    windows, exp of the mean token loss) before and after, mean over seeds, beside the objective (measured after).
    For each recovery setting (the recovery columns' values), Kendall's tau-b between the configurations'
    rankings by held-out perplexity before and after (`kendall_tau`), and the best configuration by each. None when
    no trial recovered."""
    if BEFORE not in df or AFTER not in df or df[BEFORE].isna().all():
        return None
    df = df[df[BEFORE].notna() & df[AFTER].notna()].assign(
        heldout_ppl_before=lambda d: np.exp(d[BEFORE].astype(float)),
        heldout_ppl_after=lambda d: np.exp(d[AFTER].astype(float)))
    setting = [c for c in RECOVERY_DIMENSIONS if c in df]
    pruning = [c for c in searched(df) if c not in RECOVERY_DIMENSIONS and c != "seed"]
    metric, before_metric = objective.metric, before_recovery_key(objective.metric)
    on_metric = before_metric in df and df[before_metric].notna().any()  # recovery.evaluate_before
    values = ["heldout_ppl_before", "heldout_ppl_after", *([before_metric] if on_metric else []),
              *([metric] if metric in df else [])]
    table = df.groupby(setting + pruning, dropna=False)[values].mean().reset_index()
    table["change"] = table["heldout_ppl_after"] / table["heldout_ppl_before"] - 1
    shown = [c for c in setting + pruning if table[c].astype(str).nunique() > 1]  # what tells the rows apart
    rankings = []
    groups = table.groupby(setting, dropna=False, sort=False) if setting else [((), table)]
    for key, group in groups:
        names = [", ".join(f"{c}={plain(r[c])}" for c in pruning if table[c].astype(str).nunique() > 1) or "(one)"
                 for _, r in group.iterrows()]
        entry = {"recovery": dict(zip(setting, map(plain, key if isinstance(key, tuple) else (key,)))),
                 "configurations": len(group),
                 "best_before": names[int(np.argmin(group["heldout_ppl_before"].to_numpy()))],
                 "best_after": names[int(np.argmin(group["heldout_ppl_after"].to_numpy()))]}
        entry["same_best"] = entry["best_before"] == entry["best_after"]
        if len(group) >= 3:
            entry |= kendall_tau(group["heldout_ppl_before"], group["heldout_ppl_after"], seed=seed)
        else:
            entry["reason"] = "fewer than three configurations: no ranking to compare"
        if on_metric:  # the same on the sweep's metric, measured before and after
            best = np.argmin if objective.ascending else np.argmax
            before, after = group[before_metric].to_numpy(dtype=float), group[metric].to_numpy(dtype=float)
            entry["on_metric"] = {"metric": metric, "best_before": names[int(best(before))],
                                  "best_after": names[int(best(after))]}
            entry["on_metric"]["same_best"] = entry["on_metric"]["best_before"] == entry["on_metric"]["best_after"]
            if len(group) >= 3:
                entry["on_metric"] |= kendall_tau(before, after, seed=seed)
        rankings.append(entry)
    return {"table": table[[*shown, *values, "change"]], "rankings": rankings}


def hyperparameter_importance(df: pd.DataFrame, params: tuple[str, ...] | None = None, seed: int = 0,
                              objective: Objective = ACCURACY) -> dict:
    """Optuna's fANOVA importance of each searched parameter (default: every search dimension the table has) for
    the objective metric (sums to 1 over the varied ones). A perplexity enters as log(ppl): its variance is
    otherwise that of its few largest values."""
    metric = objective.metric
    params = tuple(searched(df)) if params is None else params
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.importance import FanovaImportanceEvaluator, get_param_importances

    varied = [p for p in params if p in df and df[p].astype(str).nunique() > 1]
    if len(df) < 2 or not varied:
        return {"importances": {}, "reason": "fewer than two trials or no parameter takes two values"}
    if df[metric].nunique() < 2:
        return {
            "importances": {},
            "reason": f"{metric} is the same ({df[metric].iloc[0]:g}) in every trial: no variance to attribute",
        }
    values = np.log(df[metric].astype(float)) if multiplicative(metric) else df[metric].astype(float)
    distributions = {p: CategoricalDistribution(sorted({plain(v) for v in df[p]}, key=str)) for p in varied}
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.create_study(direction="minimize" if objective.ascending else "maximize")
        study.add_trials([
            optuna.trial.create_trial(params={p: plain(row[p]) for p in varied}, distributions=distributions,
                                      value=float(values[i]))
            for i, row in df.iterrows()
        ])
        importances = get_param_importances(study, evaluator=FanovaImportanceEvaluator(seed=seed))
    finally:
        optuna.logging.set_verbosity(verbosity)
    return {
        "importances": {k: float(v) for k, v in importances.items()},
        "reason": None,
        "of": f"log({metric})" if multiplicative(metric) else metric,
        "constant": [p for p in params if p not in varied],
    }


def value_of_search(df: pd.DataFrame, objective: Objective = ACCURACY) -> pd.DataFrame:
    """The loss from pruning each model with another model's best configuration instead of its own
    (mean over seeds where a configuration was repeated), in the objective metric's units, positive = worse.
    NaN where the target never ran that configuration."""
    rows = []
    metric = objective.metric
    best = {m: best_trial(g, objective) for m, g in df.groupby("model")}
    for source, source_best in best.items():
        config = {k: source_best[k] for k in searched(df)}
        for target, target_best in best.items():
            same = df[(df["model"] == target) & np.logical_and.reduce(
                [(df[k] == v) | (df[k].isna() & pd.isna(v)) for k, v in config.items()])]
            value = float(same[metric].mean()) if len(same) else float("nan")
            rows.append({"config_of": source, "applied_to": target, **{k: plain(v) for k, v in config.items()},
                         metric: value, f"own_best_{metric}": float(target_best[metric]),
                         "loss": objective.loss(float(target_best[metric]), value)})
    return pd.DataFrame(rows)


def cross_model(
    df: pd.DataFrame, invalid_counts: dict[str, int] | None = None, objective: Objective = ACCURACY
) -> pd.DataFrame:
    """Per model: its best trial's method, acc and ppl, and the valid-trial count; best model first."""
    rows = []
    for model, group in df.groupby("model"):
        best = best_trial(group, objective)
        rows.append({"model": model, "best_method": best["pruning_method"], "best_acc": float(best["acc_mean"]),
                     "best_ppl": plain(best.get("ppl")), "taylor_seq_len": plain(best["taylor_seq_len"]),
                     "taylor_num_samples": plain(best["taylor_num_samples"]), "valid_trials": len(group),
                     "invalid_trials": (invalid_counts or {}).get(model, 0), "trial_id": best["trial_id"]})
    columns = ["model", "best_method", "best_acc", "best_ppl", "taylor_seq_len", "taylor_num_samples",
               "valid_trials", "invalid_trials", "trial_id"]
    by = "best_ppl" if objective.metric == "ppl" else "best_acc"
    return (
        pd.DataFrame(rows, columns=columns)
        .sort_values(by, ascending=objective.ascending, kind="stable")
        .reset_index(drop=True)
    )


def key_figures(df: pd.DataFrame, tasks: tuple[str, ...], total_trials: int) -> dict:
    """The experiment's scale, cost, and accuracy and perplexity distributions (the source tools' 'key data points')."""
    acc = df["acc_mean"]
    ppl = pd.to_numeric(df["ppl"], errors="coerce") if "ppl" in df else pd.Series(dtype=float)
    hours = float(pd.to_numeric(df["time_total_s"], errors="coerce").sum() / 3600) if "time_total_s" in df else None
    return {
        "trials": total_trials, "valid_trials": len(df), "models": int(df["model"].nunique()),
        "methods": int(df["pruning_method"].nunique()), "tasks": len(tasks), "task_evaluations": len(df) * len(tasks),
        "trial_hours": hours,  # GPU-hours = trial-hours x GPUs per trial
        "acc_max": plain(acc.max()), "acc_min": plain(acc.min()), "acc_median": plain(acc.median()),
        "acc_mean": plain(acc.mean()), "acc_std": plain(acc.std()),
        "ppl_min": plain(ppl.min()), "ppl_median": plain(ppl.median()), "ppl_max": plain(ppl.max()),
    }


def plain(value):
    """numpy scalars -> Python; NaN -> None (JSON has no NaN)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value




def layout_names(df: pd.DataFrame) -> list[str]:
    """`layout_name` of each row of a table of trials or configurations; a table that names them already (the speed
    table's `layout` column) as it says."""
    if "layout" in df:
        return list(df["layout"])
    column = lambda name: df[name] if name in df else [None] * len(df)  # noqa: E731
    return [layout_name(*row) for row in zip(column("pruning_method"), column("uniform"), column("align"),
                                             column("servable"))]


def speed_quality(df: pd.DataFrame) -> pd.DataFrame | None:
    """Each trial's quality beside its measured speed against the unpruned model, with its layout
    (`layout_name`), fastest decode first (a consolidated table: its numbers are numbers); None when no trial
    measured its speed."""
    if "decode_speedup" not in df or df["decode_speedup"].isna().all():
        return None
    experts = ("expert_sparsity", "expert_criterion") if (df.get("pruning_method") == "experts").any() else ()
    columns = [c for c in ("trial_id", "pruning_method", "sparsity", *experts, "taylor_seq_len", "taylor_num_samples",
                           "acc_mean", "ppl", *SPEED_METRICS, "decode_speedup_low", "decode_speedup_high") if c in df]
    table = df[columns].copy()
    table.insert(table.columns.get_loc("pruning_method") + 1 if "pruning_method" in table else 0, "layout",
                 layout_names(df))
    return table.sort_values(["decode_speedup", "trial_id"], ascending=[False, True]).reset_index(drop=True)
