"""Paired comparisons of two trials scored on the same items (issue 64): pure functions over per-item outcomes.

An outcome table is a Series of 0/1 (or 0.0/1.0) item outcomes indexed by (task, doc_id), one per trial. Two trials
compare only on the items both scored (`shared`); where their item sets differ the comparison is not paired and the
functions say so (None) instead of pairing what was not scored twice.

acc_mean is the unweighted mean of the task accuracies, so its paired difference is the mean over tasks of each
task's mean per-item difference, and its standard error is stratified by task (the delta method, exact for a mean of
means): sqrt(sum_t s_t^2 / n_t) / T, with s_t^2 the sample variance (ddof 1) of the per-item differences in task t.
`paired_bootstrap` resamples items within each task instead; the two agree on large samples (tested), and the delta
method is what the report uses (no draws, no seed). When two variants disagree on a share d of the items, the paired
standard error is about sqrt(d / n) against sqrt(2 p (1 - p) / n) for independent samples.

Perplexity pairs by window (`paired_log_ppl`): log ppl is the summed NLL over the summed tokens, so the difference of
two trials' log-perplexities over the same windows is sum_w (nll_a,w - nll_b,w) / sum_w tokens_w, a ratio whose
standard error comes from the windows as the units (the delta method for a ratio: sqrt(sum_w (d_w - D t_w)^2 *
W / (W - 1)) / sum_w t_w, with d_w the window's NLL difference, t_w its tokens, D the difference).

Per task, `mcnemar` is the exact McNemar test: of the items the two trials answer differently, how unlikely a split
at least as uneven is when either is as likely (a two-sided binomial test at 1/2, computed from binomial
coefficients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd


@dataclass(frozen=True)
class PairedDifference:
    """acc_mean(a) - acc_mean(b) over the shared items (or log ppl(a) - log ppl(b) over the shared windows), its
    standard error, and what it rests on."""

    difference: float
    stderr: float
    items: int
    tasks: int
    method: str  # "delta" (task-stratified), "bootstrap", or "windows" (perplexity's)

    def separated(self, z: float) -> bool:
        """The difference exceeds z standard errors (a zero error separates any nonzero difference)."""
        return abs(self.difference) > z * self.stderr


def shared(a: pd.Series, b: pd.Series) -> pd.DataFrame | None:
    """The two trials' outcomes side by side (columns a and b, indexed by task and doc_id), or None when they did not
    score the same items (another fidelity, a trial stopped early): such a pair compares only as independent."""
    if a.index.has_duplicates or b.index.has_duplicates:
        raise ValueError("an item (task, doc_id) appears twice in one trial's outcomes")
    if len(a) != len(b) or not a.index.sort_values().equals(b.index.sort_values()):
        return None
    return pd.DataFrame({"a": a.astype(float), "b": b.reindex(a.index).astype(float)})


def _task_differences(pairs: pd.DataFrame) -> list[np.ndarray]:
    tasks = pairs.index.get_level_values(0)
    return [(part["a"] - part["b"]).to_numpy() for _, part in pairs.groupby(tasks, sort=True)]


def paired_difference(a: pd.Series, b: pd.Series) -> PairedDifference | None:
    """acc_mean's paired difference and its task-stratified standard error (delta method); None if not paired."""
    pairs = shared(a, b)
    if pairs is None or pairs.empty:
        return None
    per_task = _task_differences(pairs)
    variance = sum(d.var(ddof=1) / len(d) if len(d) > 1 else 0.0 for d in per_task)
    return PairedDifference(float(np.mean([d.mean() for d in per_task])), math.sqrt(variance) / len(per_task),
                            len(pairs), len(per_task), "delta")


def paired_log_ppl(a: pd.DataFrame, b: pd.DataFrame) -> PairedDifference | None:
    """log ppl(a) - log ppl(b) over the same windows and its standard error (windows as the units); `a` and `b`:
    each window's summed NLL and predicted tokens (columns nll, tokens) indexed by window. None when the two did not
    score the same windows (another text, window or window count), or scored fewer than two."""
    if len(a) != len(b) or len(a) < 2 or not a.index.sort_values().equals(b.index.sort_values()):
        return None
    b = b.reindex(a.index)
    if not np.array_equal(a["tokens"].to_numpy(), b["tokens"].to_numpy()):
        return None
    tokens = a["tokens"].to_numpy(dtype=float)
    d = a["nll"].to_numpy(dtype=float) - b["nll"].to_numpy(dtype=float)
    difference = math.fsum(d) / tokens.sum()
    residual = d - difference * tokens
    stderr = math.sqrt(math.fsum(residual**2) * len(d) / (len(d) - 1)) / tokens.sum()
    return PairedDifference(difference, stderr, len(d), 1, "windows")


def paired_bootstrap(a: pd.Series, b: pd.Series, draws: int = 2000, seed: int = 0) -> PairedDifference | None:
    """The same difference, its standard error from `draws` resamplings of the items within each task (the same
    draw for both trials: the pairs are resampled); None if not paired."""
    pairs = shared(a, b)
    if pairs is None or pairs.empty:
        return None
    rng = np.random.default_rng(seed)
    per_task = _task_differences(pairs)
    means = np.zeros(draws)
    for d in per_task:
        means += d[rng.integers(0, len(d), size=(draws, len(d)))].mean(axis=1)
    means /= len(per_task)
    return PairedDifference(float(np.mean([d.mean() for d in per_task])), float(means.std(ddof=1)), len(pairs),
                            len(per_task), "bootstrap")


def mcnemar(a: pd.Series, b: pd.Series) -> dict | None:
    """The exact McNemar test of two trials on one task's shared items: the discordant counts (a right where b is
    wrong, and the other way) and the two-sided p-value; None if not paired."""
    pairs = shared(a, b)
    if pairs is None:
        return None
    only_a = int(((pairs["a"] > 0) & (pairs["b"] == 0)).sum())
    only_b = int(((pairs["b"] > 0) & (pairs["a"] == 0)).sum())
    n = only_a + only_b
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2**n
    return {"only_a": only_a, "only_b": only_b, "discordant": n, "p": min(1.0, 2 * tail)}
