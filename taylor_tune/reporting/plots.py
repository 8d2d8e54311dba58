"""Figures of a report: each is first computed as a plain data object (testable), then rendered headless.

Rendering uses matplotlib's object API (`Figure` + the Agg canvas), never pyplot, so that no global
backend or figure state is touched and nothing happens at import time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from taylor_tune.reporting.stats import layout_names, multiplicative
from taylor_tune.schema import before_recovery_key


@dataclass
class HeatmapData:
    """The metric per (taylor_seq_len, taylor_num_samples) cell for one model, over methods and seeds: the mean of
    an accuracy, the geometric mean of a perplexity (an arithmetic mean of ppl is the worst method's number)."""

    model: str
    seq_lens: list[int]
    num_samples: list[int]
    values: list[list[float | None]]  # [seq_len index][num_samples index]; None where no trial ran
    counts: list[list[int]]
    metric: str = "acc_mean"
    aggregate: str = "mean"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class MethodBars:
    """Mean of the metric for each method on each model, with the std over its trials as the error bar; for ppl
    the geometric mean and the geometric std factor (the bar spans mean / factor ... mean x factor), since a
    perplexity's spread is multiplicative and mean - std would fall below zero."""

    models: list[str]
    methods: list[str]
    means: list[list[float | None]]  # [method index][model index]
    stds: list[list[float | None]]
    counts: list[list[int]]
    metric: str = "acc_mean"
    aggregate: str = "mean"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LayerProfile:
    """Per-layer data of one trial (from its layer_analysis.json)."""

    title: str
    layers: list[int]
    pruning_ratio: list[float]
    retention_ratio: list[float]
    grad_mean: list[float | None]
    grad_norm: list[float | None]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SpeedQuality:
    """Per method, each trial's measured decode speedup (batch 1) against its acc_mean and its ppl."""

    model: str
    methods: list[str]
    speedup: list[list[float | None]]  # [method index][trial]
    acc_mean: list[list[float | None]]
    ppl: list[list[float | None]]
    labels: list[list[str]]  # each trial's layout (`stats.layout_name`)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ParetoData:
    """The first two objectives of a Pareto front: every configuration with its uncertainty, the front marked."""

    model: str
    x_metric: str  # the second objective (e.g. decode_speedup)
    y_metric: str  # the first (the sweep's metric)
    y_log: bool
    y_lower_better: bool
    x_lower_better: bool
    methods: list[str]
    x: list[list[float]]  # [method index][point]
    y: list[list[float]]
    x_se: list[list[float | None]]
    y_se: list[list[float | None]]
    on_front: list[list[bool]]
    labels: list[list[str]]  # each point's layout (`stats.layout_name`)
    points: list[list[str]]
    front_x: list[float]  # the front in order of x, for its line
    front_y: list[float]
    # with recovery.evaluate_before: each point before its recovery (a speed is what recovery does not change)
    before_x: list[list[float]] = field(default_factory=list)
    before_y: list[list[float]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _none_if_nan(value) -> float | None:
    return None if value is None or pd.isna(value) else float(value)


def heatmap_data(df: pd.DataFrame, model: str, metric: str = "acc_mean") -> HeatmapData:
    rows = df[df["model"] == model]
    geometric = multiplicative(metric)
    if geometric:
        rows = rows.assign(**{metric: np.log(rows[metric].astype(float))})
    table = rows.pivot_table(
        index="taylor_seq_len", columns="taylor_num_samples", values=metric, aggfunc=["mean", "count"]
    )
    seq_lens = sorted(int(v) for v in rows["taylor_seq_len"].unique())
    samples = sorted(int(v) for v in rows["taylor_num_samples"].unique())
    means = (
        table["mean"].reindex(index=seq_lens, columns=samples)
        if len(rows)
        else pd.DataFrame(index=seq_lens, columns=samples)
    )
    counts = table["count"].reindex(index=seq_lens, columns=samples).fillna(0) if len(rows) else means.fillna(0)
    if geometric:
        means = np.exp(means.astype(float))
    return HeatmapData(
        model,
        seq_lens,
        samples,
        [[_none_if_nan(v) for v in r] for r in means.to_numpy()],
        [[int(v) for v in r] for r in counts.to_numpy()],
        metric,
        "geometric mean" if geometric else "mean",
    )


def method_bars(df: pd.DataFrame, metric: str = "acc_mean") -> MethodBars:
    models = sorted(df["model"].unique())
    methods = sorted(df["pruning_method"].unique())
    geometric = multiplicative(metric)
    values = np.log(df[metric].astype(float)) if geometric else df[metric]
    stats = values.groupby([df["pruning_method"], df["model"]]).agg(["mean", "std", "count"])
    if geometric:
        stats[["mean", "std"]] = np.exp(stats[["mean", "std"]])

    def grid(column, convert):
        return [[convert(stats[column].get((m, model), np.nan)) for model in models] for m in methods]

    return MethodBars(
        models,
        methods,
        grid("mean", _none_if_nan),
        grid("std", _none_if_nan),
        grid("count", lambda v: 0 if pd.isna(v) else int(v)),
        metric,
        "geometric mean" if geometric else "mean",
    )


def speed_quality_data(table: pd.DataFrame, model: str) -> SpeedQuality:
    """From `stats.speed_quality`'s table of one model."""
    methods = sorted(table["pruning_method"].dropna().unique())
    rows = [table[table["pruning_method"] == m] for m in methods]

    def column(name):
        return [[_none_if_nan(v) for v in r[name]] if name in r else [None] * len(r) for r in rows]

    return SpeedQuality(model, methods, column("decode_speedup"), column("acc_mean"), column("ppl"),
                        [layout_names(r) for r in rows])


def pareto_data(front: pd.DataFrame, model: str, objectives) -> ParetoData:
    """From `pareto.pareto_front`'s table of one model (its first two objectives)."""
    y, x = objectives[0].metric, objectives[1].metric
    methods = sorted(front["pruning_method"].dropna().astype(str).unique()) if "pruning_method" in front else ["all"]
    rows = [front[front["pruning_method"] == m] if "pruning_method" in front else front for m in methods]
    line = front[front["on_front"]].sort_values(x)
    return ParetoData(
        model, x, y, multiplicative(y), objectives[0].ascending, objectives[1].ascending, methods,
        [[float(v) for v in r[x]] for r in rows], [[float(v) for v in r[y]] for r in rows],
        [[_none_if_nan(v) for v in r[f"{x}_se"]] for r in rows],
        [[_none_if_nan(v) for v in r[f"{y}_se"]] for r in rows],
        [[bool(v) for v in r["on_front"]] for r in rows],
        [layout_names(r) for r in rows],
        [[str(v) for v in r["point"]] for r in rows],
        [float(v) for v in line[x]], [float(v) for v in line[y]],
        *_before_points(rows, x, y),
    )


def _before_points(rows: list[pd.DataFrame], x: str, y: str) -> tuple[list, list]:
    """Per method, the points before recovery (`pareto_front`'s before_recovery_ columns), or nothing."""
    bx, by = before_recovery_key(x), before_recovery_key(y)
    if not any(c in r for r in rows for c in (bx, by)):
        return [], []
    return ([[float(v) for v in (r[bx] if bx in r else r[x])] for r in rows],
            [[float(v) for v in (r[by] if by in r else r[y])] for r in rows])


def layer_profile(layers: list[dict], title: str) -> LayerProfile:
    return LayerProfile(
        title,
        [int(r["layer"]) for r in layers],
        [float(r["pruning_ratio"]) for r in layers],
        [float(r["retention_ratio"]) for r in layers],
        [_none_if_nan(r.get("grad_mean")) for r in layers],
        [_none_if_nan(r.get("grad_norm")) for r in layers],
    )


# ---------------------------------------------------------------- rendering


def _figure(width: float, height: float, ncols: int = 1):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    return figure, figure.subplots(1, ncols, squeeze=False)[0]


def _as_array(values) -> np.ndarray:
    return np.array([[np.nan if v is None else v for v in row] for row in values], dtype=float)


def render_heatmap(data: HeatmapData, path: Path) -> None:
    figure, (ax,) = _figure(1.4 + 1.1 * max(len(data.num_samples), 1), 1.2 + 0.55 * max(len(data.seq_lens), 1))
    values = _as_array(data.values) if data.values else np.full((1, 1), np.nan)
    lower_is_better = multiplicative(data.metric)
    image = ax.imshow(values, cmap="YlGnBu_r" if lower_is_better else "YlGnBu", aspect="auto")  # dark = best
    ax.set_xticks(range(len(data.num_samples)), [str(v) for v in data.num_samples])
    ax.set_yticks(range(len(data.seq_lens)), [str(v) for v in data.seq_lens])
    for (i, j), value in np.ndenumerate(values):
        if np.isfinite(value):  # white on the dark half of the colour map, black on the light half
            red, green, blue, _ = image.cmap(image.norm(value))
            ax.text(j, i, f"{value:.1f}" if lower_is_better else f"{value:.3f}", ha="center", va="center", fontsize=8,
                    color="white" if 0.299 * red + 0.587 * green + 0.114 * blue < 0.5 else "black")
    ax.set_xlabel("taylor_num_samples")
    ax.set_ylabel("taylor_seq_len")
    ax.set_title(f"{data.model}: {data.aggregate} {data.metric} over methods")
    figure.colorbar(image, ax=ax)
    figure.savefig(path, dpi=120)


def render_method_bars(data: MethodBars, path: Path) -> None:
    figure, (ax,) = _figure(2 + 1.6 * max(len(data.models), 1), 3.6)
    width = 0.8 / max(len(data.methods), 1)
    x = np.arange(len(data.models))
    for k, method in enumerate(data.methods):
        means = _as_array([data.means[k]])[0]
        if data.aggregate == "geometric mean":  # mean / factor ... mean x factor
            factors = np.nan_to_num(_as_array([data.stds[k]])[0], nan=1.0)
            errors = np.array([means - means / factors, means * factors - means])
        else:
            errors = np.nan_to_num(_as_array([data.stds[k]])[0])
        ax.bar(x + (k - (len(data.methods) - 1) / 2) * width, means, width, yerr=errors, capsize=3, label=method)
    ax.set_xticks(x, data.models)
    if data.aggregate == "geometric mean":
        ax.set_ylabel(f"{data.metric} (geometric mean ×/÷ geometric std)")
        ax.set_yscale("log")  # methods' perplexities differ by orders of magnitude
    else:
        ax.set_ylabel(f"{data.metric} (mean ± std over trials)")
    ax.legend(fontsize=8)
    figure.savefig(path, dpi=120)


def render_layer_plots(data: LayerProfile, folder: Path) -> dict[str, Path]:
    """gradient_analysis.png, pruning_ratio.png and retention_ratio.png for one trial."""
    paths = {name: folder / f"{name}.png" for name in ("gradient_analysis", "pruning_ratio", "retention_ratio")}
    figure, (left, right) = _figure(9, 3.2, ncols=2)
    for ax, values, label in ((left, data.grad_mean, "mean |gradient|"), (right, data.grad_norm, "gradient norm")):
        ax.plot(data.layers, _as_array([values])[0], marker="o")
        ax.set_xticks(data.layers)
        ax.set_xlabel("layer")
        ax.set_ylabel(label)
    figure.suptitle(f"{data.title}: per-layer gradient statistics")
    figure.savefig(paths["gradient_analysis"], dpi=120)
    for name, values in (("pruning_ratio", data.pruning_ratio), ("retention_ratio", data.retention_ratio)):
        figure, (ax,) = _figure(6, 3.2)
        ax.bar(data.layers, values)
        ax.set_xticks(data.layers)
        ax.set_xlabel("layer")
        ax.set_ylabel(name.replace("_", " "))
        ax.set_ylim(0, 1)
        ax.set_title(f"{data.title}: per-layer {name.replace('_', ' ')}")
        figure.savefig(paths[name], dpi=120)
    return paths


# A trial's marker tells its layout: a circle where every width is the importance's own or the layers are stock
# (filled: one shape for all, uniform or depth), a square where widths are aligned, a diamond for the servable one.
_MARKERS = {"free": ("o", False), "uniform": ("o", True), "depth": ("o", True), "servable": ("D", False)}


def _marker(label: str) -> tuple[str, bool]:
    return _MARKERS.get(label, ("s", False))  # `align N`


def _scatter(ax, x, y, color, layout: str, **kw) -> None:
    marker, filled = _marker(layout)
    ax.scatter(x, y, color=color, facecolors=color if filled else "none", marker=marker, **kw)


def _layout_legend(ax, labels: list[list[str]]) -> None:
    """One grey legend entry per marker the figure shows, naming its layouts (after the methods' colours)."""
    shown: dict[tuple[str, bool], list[str]] = {}
    for layout in sorted({layout for row in labels for layout in row},
                         key=lambda name: (name.split()[0], int(name.split()[-1]) if " " in name else 0)):
        shown.setdefault(_marker(layout), []).append(layout)
    for layouts in shown.values():
        _scatter(ax, [], [], "grey", layouts[0], label=", ".join(layouts))


def render_speed_quality(data: SpeedQuality, path: Path) -> None:
    """acc_mean and ppl against the measured decode speedup; a marker per layout (`_MARKERS`)."""
    figure, (left, right) = _figure(9, 3.6, ncols=2)
    for k, method in enumerate(data.methods):
        color = f"C{k}"
        for ax, values in ((left, data.acc_mean[k]), (right, data.ppl[k])):
            for x, y, label in zip(data.speedup[k], values, data.labels[k]):
                if x is not None and y is not None:
                    _scatter(ax, x, y, color, label, s=30)
        left.scatter([], [], color=color, label=method)  # one legend entry per method
    _layout_legend(left, data.labels)
    for ax, label in ((left, "acc_mean (higher is better)"), (right, "ppl (lower is better)")):
        ax.axvline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("decode speedup against the unpruned model (batch 1)")
        ax.set_ylabel(label)
    from matplotlib.ticker import FormatStrFormatter

    right.set_yscale("log")  # plain numbers on the ticks: a narrow range shows only minor ones
    for ticks in (right.yaxis.set_major_formatter, right.yaxis.set_minor_formatter):
        ticks(FormatStrFormatter("%.4g"))
    left.legend(fontsize=8)
    figure.suptitle(f"{data.model}: quality against measured speed (marker: layout)")
    figure.savefig(path, dpi=120)


def render_pareto(data: ParetoData, path: Path) -> None:
    """Every configuration (a marker per layout, `_MARKERS`), error bars where an uncertainty was measured,
    the front as a step line through its points, larger markers on the front."""
    figure, (ax,) = _figure(6.4, 4.2)
    for k, method in enumerate(data.methods):
        color = f"C{k}"
        for x, y, xs, ys, front, label in zip(data.x[k], data.y[k], data.x_se[k], data.y_se[k], data.on_front[k],
                                              data.labels[k]):
            if xs is not None or ys is not None:
                ax.errorbar(x, y, xerr=xs, yerr=ys, color=color, lw=0.8, capsize=2)
            _scatter(ax, x, y, color, label, s=50 if front else 20, zorder=3)
        ax.scatter([], [], color=color, label=method)
        if data.before_y:
            ax.scatter(data.before_x[k], data.before_y[k], color=color, alpha=0.25, s=16, marker="o", lw=0, zorder=2)
    _layout_legend(ax, data.labels)
    if data.before_y:
        ax.scatter([], [], color="grey", alpha=0.25, s=16, lw=0, label="before recovery")
    # the edge of what the front dominates: between two front points it runs at the level of the one further along x
    # when x is better higher, of the one before when x is better lower
    ax.step(data.front_x, data.front_y, where="post" if data.x_lower_better else "pre", color="black", lw=0.9,
            ls="--", label="front")
    if data.y_log:
        from matplotlib.ticker import FormatStrFormatter, NullFormatter

        ax.set_yscale("log")
        values = [v for row in data.y for v in row if v > 0]
        narrow = bool(values) and max(values) / min(values) < 10  # within a decade only minor ticks fall inside
        ax.yaxis.set_major_formatter(FormatStrFormatter("%.4g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%.4g") if narrow else NullFormatter())
    ax.set_xlabel(data.x_metric)
    ax.set_ylabel(f"{data.y_metric} ({'lower' if data.y_lower_better else 'higher'} is better)")
    ax.legend(fontsize=8)
    figure.suptitle(f"{data.model}: Pareto front (marker: layout; large: on the front)")
    figure.savefig(path, dpi=120)
