"""Several objectives at once: configurations, their Pareto front, who dominates whom, the best under constraints.

Pure (pandas / numpy), no files, no plots. A point is a configuration: the trials that share every search dimension
(`stats.searched`) and differ only in the calibration seed. Its value in each metric is the mean over those seeds
(a perplexity's the geometric mean, as everywhere in the report), and its uncertainty `<metric>_se` combines

- the spread over seeds, std / sqrt(seeds), where a configuration ran with more than one seed, and
- for accuracies, the item-sampling standard error lm-eval gives (`acc_mean_stderr`, `acc_<task>_stderr`), the mean
  over seeds of its square (every seed answers the same items, so it does not shrink with more seeds),

added in quadrature; NaN where neither was measured (one seed of a perplexity or a speed).

A point dominates another when it is at least as good in every objective and better in one (each objective in its
own direction); the front is the points no other point dominates, computed on the means.

Whether a dominator's lead is resolved (`tied_with`) is judged on paired intervals where the trials allow it
(`paired_resolved`): acc_mean by the per-item differences on the items both configurations scored (`paired.
paired_difference`, items averaged over each configuration's seeds, the seeds' spread added), perplexity by the
per-window differences of log ppl (`paired.paired_log_ppl`), a speedup by the two points' own intervals, each timed
interleaved with the unpruned model (evaluation/speed.py), compared on the log scale. Anything else, and any pair
without shared items, falls back to the independent bound (`resolved`).
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from taylor_tune.paired import paired_difference, paired_log_ppl
from taylor_tune.reporting.stats import Z95, Objective, multiplicative, searched
from taylor_tune.schema import before_recovery_key

_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
# unambiguous (each digit can match one way only), so a long non-number fails in linear time
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_CONSTRAINT = re.compile(rf"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|>|<)\s*({_NUMBER})\s*")
MAX_CONSTRAINT = 200  # characters


@dataclass(frozen=True)
class Constraint:
    """`metric op value`, e.g. decode_speedup >= 1.3; it holds for a configuration's mean over its seeds."""

    metric: str
    op: str
    value: float
    number: str = field(default="", compare=False)  # the value as it was written, kept as given

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.number or repr(self.value)}"

    def holds(self, values: pd.Series) -> pd.Series:
        return _OPS[self.op](pd.to_numeric(values, errors="coerce"), self.value).fillna(False).astype(bool)


def parse_constraint(text: str) -> Constraint:
    """"decode_speedup>=1.3" -> Constraint; ValueError naming what is allowed otherwise (a finite number, at most
    MAX_CONSTRAINT characters in all)."""
    match = _CONSTRAINT.fullmatch(text) if len(text) <= MAX_CONSTRAINT else None
    value = float(match[3]) if match else math.nan
    if not math.isfinite(value):
        shown = repr(text) if len(text) <= 60 else f"{text[:60]!r}... ({len(text)} characters)"
        raise ValueError(f"{shown} is not a constraint; write METRIC OP NUMBER with OP one of >=, <=, >, < and a "
                         f"finite number, at most {MAX_CONSTRAINT} characters (e.g. \"decode_speedup>=1.3\")")
    return Constraint(match[1], match[2], value, match[3])


def _item_stderr(group: pd.DataFrame, metric: str) -> float:
    """The measurement's own error: an accuracy's stderr over its items, a speed's `_se` over its timed repeats
    (evaluation/speed.py); root mean square over the configuration's trials."""
    column = "acc_mean_stderr" if metric == "acc_mean" else f"{metric}_stderr"
    if not metric.startswith("acc_"):
        column = f"{metric}_se"
    if column not in group:
        return math.nan
    se = pd.to_numeric(group[column], errors="coerce").to_numpy(dtype=float)
    return float(np.sqrt(np.mean(se**2))) if np.isfinite(se).all() else math.nan


def configurations(df: pd.DataFrame, metrics: list[str]) -> pd.DataFrame:
    """One row per configuration of `df` (one model's valid trials): `point` (its first trial's id), `trials`
    (every trial id, ';'-joined), `seeds`, the search dimensions, and per metric its mean and `<metric>_se`."""
    columns = searched(df)
    rows = []
    for key, group in df.groupby(columns, dropna=False, sort=False) if columns else [((), df)]:
        ids = sorted(group["trial_id"].astype(str))
        row = {"point": ids[0], "trials": ";".join(ids), "seeds": len(group),
               **dict(zip(columns, key if isinstance(key, tuple) else (key,)))}
        for metric in metrics:
            values = pd.to_numeric(group[metric], errors="coerce").to_numpy(dtype=float) if metric in group \
                else np.array([math.nan])
            if multiplicative(metric) and np.all(values > 0) and np.ptp(values) > 0:
                # exp(log(v)) is not v to the last bit: one seed's 30.0 must still meet ppl<=30
                row[metric] = float(np.exp(np.mean(np.log(values))))
            else:
                row[metric] = float(np.mean(values))
            seed_se = float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.nan
            parts = [p for p in (seed_se, _item_stderr(group, metric)) if not math.isnan(p)]
            row[f"{metric}_se"] = float(math.sqrt(sum(p * p for p in parts))) if parts else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def dominance(values: np.ndarray, objectives: tuple[Objective, ...]) -> np.ndarray:
    """dom[i, j]: point i dominates point j (values: points x objectives, in the objectives' order)."""
    better = np.where([o.ascending for o in objectives], -values, values)  # higher is better in every column
    at_least = (better[:, None, :] >= better[None, :, :]).all(axis=2)
    strictly = (better[:, None, :] > better[None, :, :]).any(axis=2)
    return at_least & strictly


def resolved(values: np.ndarray, errors: np.ndarray, objectives: tuple[Objective, ...], z: float) -> np.ndarray:
    """res[i, j]: point i is better than point j by more than z standard errors of the difference,
    z * sqrt(se_i^2 + se_j^2), in at least one objective (an unknown se counts as 0: the means decide)."""
    better = np.where([o.ascending for o in objectives], -values, values)
    se = np.nan_to_num(errors, nan=0.0)
    margin = z * np.sqrt(se[:, None, :] ** 2 + se[None, :, :] ** 2)
    return ((better[:, None, :] - better[None, :, :]) > margin).any(axis=2)


def _seed_se(df: pd.DataFrame, ids: list[str], metric: str) -> float:
    """The standard error of a configuration's mean over its seeds from their spread (0 with one seed); a perplexity's
    or a speedup's on the log scale, the one it is compared on."""
    values = pd.to_numeric(df.loc[df["trial_id"].astype(str).isin(ids), metric], errors="coerce").to_numpy(float)
    values = np.log(values) if multiplicative(metric) or metric.endswith("_speedup") else values
    return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0


def _items(ids: list[str], kept: dict) -> pd.Series | pd.DataFrame | None:
    """A configuration's per-item outcomes (or windows) averaged over its seeds, when every seed kept them on the
    same items; None otherwise."""
    parts = [kept.get(i) for i in ids]
    if any(p is None for p in parts) or any(not p.index.sort_values().equals(parts[0].index.sort_values())
                                            for p in parts):
        return None
    return sum(p.reindex(parts[0].index) for p in parts) / len(parts)


def _speed_half_width(low: float, high: float) -> float:
    """Half the width of a speedup's 95% interval on the log scale (NaN where it has none)."""
    return (math.log(high) - math.log(low)) / 2 if low > 0 and high >= low else math.nan


def paired_resolved(table: pd.DataFrame, df: pd.DataFrame, objectives: tuple[Objective, ...], z: float,
                    outcomes: dict | None = None, windows: dict | None = None,
                    pairs: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(res, paired) for the configurations of `table` (`configurations` of `df`) over the point pairs `pairs`
    selects (all by default; the others stay False): res[i, j], point i is better than point j beyond the
    uncertainty in at least one objective; paired[i, j], some objective of the pair was judged paired.

    Per objective: acc_mean on the shared items, z paired standard errors (`paired_difference`, the seeds' spread
    of both added in quadrature); ppl on the shared windows in log ppl (`paired_log_ppl`, likewise); a
    `<x>_speedup` that has `_low`/`_high` (each point timed interleaved with the unpruned model) by its log-ratio
    against the two 95% half-widths in quadrature (scaled by z / Z95); anything else, and a pair without shared
    items, by `resolved`'s independent bound."""
    values = table[[o.metric for o in objectives]].to_numpy(dtype=float)
    errors = table[[f"{o.metric}_se" for o in objectives]].to_numpy(dtype=float)
    res = np.zeros((len(table), len(table)), dtype=bool)
    paired = np.zeros_like(res)
    pairs = ~np.eye(len(table), dtype=bool) if pairs is None else pairs & ~np.eye(len(table), dtype=bool)
    ids = [t.split(";") for t in table["trials"]]
    for k, objective in enumerate(objectives):
        independent = resolved(values[:, [k]], errors[:, [k]], (objective,), z)
        lead = _paired_lead(objective, values[:, k], ids, df, z, outcomes, windows)
        for a, b in zip(*np.nonzero(pairs)):
            verdict = lead(a, b)
            res[a, b] |= independent[a, b] if verdict is None else verdict
            paired[a, b] |= verdict is not None
    return res, paired


def _paired_lead(objective: Objective, values: np.ndarray, ids: list[list[str]], df: pd.DataFrame, z: float,
                 outcomes: dict | None, windows: dict | None):
    """lead(a, b): whether point a beats point b in `objective` beyond its paired interval, or None where the two
    cannot be paired in it (`paired_resolved`)."""
    metric, sign = objective.metric, (-1.0 if objective.ascending else 1.0)
    spread = [_seed_se(df, i, metric) for i in ids]  # once per configuration, not once per pair

    def beyond(pair, a, b) -> bool | None:  # a PairedDifference of a minus b, seeds' spread added
        if pair is None:
            return None
        se = math.hypot(pair.stderr, spread[a], spread[b])
        return bool(sign * pair.difference > z * se)

    if metric == "acc_mean" and outcomes:
        items = [_items(i, outcomes) for i in ids]
        return lambda a, b: beyond(None if items[a] is None or items[b] is None
                                   else paired_difference(items[a], items[b]), a, b)
    if metric == "ppl" and windows:
        kept = [_items(i, windows) for i in ids]
        return lambda a, b: beyond(None if kept[a] is None or kept[b] is None
                                   else paired_log_ppl(kept[a], kept[b]), a, b)
    if metric.endswith("_speedup") and {f"{metric}_low", f"{metric}_high"} <= set(df):
        half = []
        for i, seeds in zip(ids, spread):
            rows = df[df["trial_id"].astype(str).isin(i)]
            bounds = [pd.to_numeric(rows[f"{metric}_{end}"], errors="coerce").mean() for end in ("low", "high")]
            half.append(math.hypot(_speed_half_width(*bounds) * z / Z95, z * seeds))

        def speed(a, b):
            if not (math.isfinite(half[a]) and math.isfinite(half[b]) and values[a] > 0 and values[b] > 0):
                return None
            return bool(sign * (math.log(values[a]) - math.log(values[b])) > math.hypot(half[a], half[b]))
        return speed
    return lambda a, b: None


def pareto_front(df: pd.DataFrame, objectives: tuple[Objective, ...], z: float = Z95, outcomes: dict | None = None,
                 windows: dict | None = None) -> pd.DataFrame:
    """Every configuration of one model's valid trials with its objectives' means and uncertainties, `on_front`,
    `dominated_by` (the points that dominate it, ';'-joined; '' on the front) and `tied_with` (those of them whose
    lead lies within the uncertainty in every objective, `paired_resolved`: paired where `outcomes` (trial_id -> its
    items' outcomes) or `windows` (trial_id -> its perplexity windows) allow, else the independent bound; such a
    point is off the front by its means only). attrs: `left_out` (configurations missing an objective),
    `separated_by_pairing` (dominations the independent bound calls tied and the paired intervals resolve) and
    `paired` (dominations judged paired in some objective). The front comes first, ordered by the first objective,
    best first."""
    metrics = [o.metric for o in objectives]
    table = configurations(df, metrics)
    if table.empty:
        table = table.assign(on_front=pd.Series(dtype=bool), dominated_by=pd.Series(dtype=object),
                             tied_with=pd.Series(dtype=object))
        table.attrs.update(left_out=0, separated_by_pairing=0, paired=0)
        return table
    complete = np.isfinite(table[metrics].to_numpy(dtype=float)).all(axis=1)
    left_out = int((~complete).sum())
    table = table[complete].reset_index(drop=True)
    dom = dominance(table[metrics].to_numpy(dtype=float), objectives)
    points = table["point"].to_numpy()
    table["on_front"] = ~dom.any(axis=0)
    table["dominated_by"] = [";".join(sorted(points[dom[:, j]])) for j in range(len(table))]
    errors = table[[f"{m}_se" for m in metrics]].to_numpy(dtype=float)
    independent_tie = dom & ~resolved(table[metrics].to_numpy(dtype=float), errors, objectives, z)
    res, paired = paired_resolved(table, df, objectives, z, outcomes, windows, pairs=dom)
    tied = dom & ~res
    table["tied_with"] = [";".join(sorted(points[tied[:, j]])) for j in range(len(table))]
    separated_by_pairing, judged_paired = int((independent_tie & ~tied).sum()), int((dom & paired).sum())
    first = objectives[0]
    table = table.sort_values(["on_front", first.metric, "point"], ascending=[False, first.ascending, True],
                              kind="stable").reset_index(drop=True)
    if "pruning_method" in table:  # what kind of cut each point is: whole layers, groups within them, or both
        shares = table["depth_share"] if "depth_share" in table else [0.0] * len(table)
        table.insert(1, "family", ["depth" if m == "depth" else "mixed" if share and share > 0 else "width"
                                   for m, share in zip(table["pruning_method"], shares)])
    before = [before_recovery_key(m) for m in metrics if before_recovery_key(m) in df
              and df[before_recovery_key(m)].notna().any()]
    if before:  # recovery.evaluate_before: where each configuration stood before its recovery
        table = table.merge(configurations(df, before)[["point", *before]], on="point", how="left")
    table.attrs.update(left_out=left_out, separated_by_pairing=separated_by_pairing, paired=judged_paired)
    return table


def best_under(df: pd.DataFrame, constraints: tuple[Constraint, ...], objective: Objective) -> dict:
    """The configuration with the best `objective` among those whose means meet every constraint (ties: the
    smaller point id), or why there is none. A metric no trial reports raises ValueError."""
    for constraint in constraints:
        if constraint.metric not in df:
            raise ValueError(f"constraint {constraint}: {constraint.metric!r} is not a column of these trials")
    metrics = list(dict.fromkeys([objective.metric, *(c.metric for c in constraints)]))
    table = configurations(df, metrics)
    if table.empty:
        return {"constraints": [str(c) for c in constraints], "satisfying": 0, "of": 0, "best": None,
                "reason": "no valid trials"}
    keep = np.logical_and.reduce([c.holds(table[c.metric]) for c in constraints]) if constraints else \
        np.ones(len(table), dtype=bool)
    meeting = table[keep & table[objective.metric].notna().to_numpy()]
    out = {"constraints": [str(c) for c in constraints], "satisfying": len(meeting), "of": len(table),
           "objective": {"metric": objective.metric, "mode": objective.mode}}
    if meeting.empty:
        return out | {"best": None, "reason": "no configuration meets every constraint"}
    best = meeting.sort_values([objective.metric, "point"], ascending=[objective.ascending, True], kind="stable")
    return out | {"best": best.iloc[0].to_dict(), "reason": None}
