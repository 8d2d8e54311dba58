"""The analysis report: `build_report` computes it (no files), `render_text` / `render_markdown` print it,
`write_report` writes every file of a report folder (the only function here that touches the disk).

The sections follow the source tools' report (reference/004) for each model, then the cross-model
comparison, plus what they lacked: stderr and confidence intervals, whether the best lead is real,
seed spread, held-out selection, fANOVA importance, the value of a per-model search, quality against measured speed,
the Pareto front of the objectives (`pareto`) and the best configuration under constraints.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from taylor_tune.errors import ReportError
from taylor_tune.jsonio import write_json
from taylor_tune.reporting import latex, pareto, plots, stats
from taylor_tune.reporting.frame import ARTIFACTS, GRAD_COLUMNS, TrialTable, load_trials, open_filesystem, read_text
from taylor_tune.schema import CONFIG_COLUMNS, task_columns


@dataclass
class ModelReport:
    model: str
    trials: int
    valid: pd.DataFrame
    invalid: pd.DataFrame
    tasks: tuple[str, ...]
    methods: dict
    seq_len: dict
    num_samples: dict
    gradient: list[stats.Correlation]
    extreme: dict
    ppl: stats.Correlation
    best: pd.Series | None
    best_stderr: float | None
    lead: stats.Lead
    seeds: dict
    heldout: dict
    importance: dict
    speed: pd.DataFrame | None = None  # quality against measured speed, per trial (None: no trial measured it)
    objective: stats.Objective = stats.ACCURACY
    front_objectives: tuple[stats.Objective, ...] = ()  # what the Pareto front trades off (empty: no front)
    front: pd.DataFrame | None = None  # pareto.pareto_front: every configuration, the front first
    constrained: dict | None = None  # pareto.best_under, when constraints were asked for


@dataclass
class Report:
    source: str
    table: TrialTable
    models: dict[str, ModelReport]
    cross: pd.DataFrame
    value_of_search: pd.DataFrame
    key: dict
    z: float = stats.Z95
    notes: list[str] = field(default_factory=list)
    objective: stats.Objective = stats.ACCURACY

    @property
    def overall_best(self) -> dict | None:
        return None if self.cross.empty else self.cross.iloc[0].to_dict()


def front_objectives(objectives: tuple[stats.Objective, ...], valid: pd.DataFrame) -> tuple[stats.Objective, ...]:
    """The sweep's objectives when it searched several; else its metric against the measured decode speedup when
    its trials measured speed (the trade-off a user asks about); else none."""
    if len(objectives) > 1:
        return objectives
    speed = stats.Objective("decode_speedup", "max")
    if objectives[0] != speed and "decode_speedup" in valid and valid["decode_speedup"].notna().any():
        return (objectives[0], speed)
    return ()


def model_report(table: TrialTable, model: str, z: float = stats.Z95, seed: int = 0,
                 objective: stats.Objective | None = None, constraints: tuple[pareto.Constraint, ...] = ()
                 ) -> ModelReport:
    """Everything the report says about one model; `constraints`: also the best configuration meeting them all."""
    objective = objective or table.objective
    trials = table.trials[table.trials["model"] == model]
    valid = trials[trials["valid"]].copy()
    tasks = task_columns(valid.columns[valid.notna().any()]) if len(valid) else ()
    valid["acc_mean_stderr"] = stats.acc_mean_stderr(valid, tasks)
    best = stats.best_trial(valid, objective)
    metric = objective.metric
    heldout = stats.heldout_selection(valid, tasks) if metric == "acc_mean" else {
        "reason": f"the sweep ranks by {metric}; the held-out halves are of the zero-shot accuracies"}
    objectives = table.objectives
    objectives = objectives if objectives[0] == objective else (objective,)
    front_of = front_objectives(objectives, valid)
    try:
        constrained = pareto.best_under(valid, constraints, objective) if constraints else None
    except ValueError as error:
        raise ReportError(f"--constraint: {error}") from None
    return ModelReport(
        model=model, trials=len(trials), valid=valid, invalid=trials.loc[~trials["valid"]], tasks=tasks,
        methods=stats.method_comparison(valid, objective),
        seq_len=stats.hyperparameter_impact(valid, "taylor_seq_len", objective),
        num_samples=stats.hyperparameter_impact(valid, "taylor_num_samples", objective),
        gradient=[stats.correlation(valid, g, metric) for g in GRAD_COLUMNS],
        extreme=stats.extreme_layers(valid, objective),
        # perplexity against accuracy either way round: the one the sweep did not rank by is the other's check
        ppl=stats.correlation(valid, "ppl", "acc_mean"),
        best=best, best_stderr=None if best is None else stats.plain(best["acc_mean_stderr"]),
        lead=stats.lead_of_best(valid, tasks, z, objective), seeds=stats.seed_spread(valid, objective), heldout=heldout,
        importance=stats.hyperparameter_importance(valid, seed=seed, objective=objective),
        speed=stats.speed_quality(valid), objective=objective, front_objectives=front_of,
        front=pareto.pareto_front(valid, front_of) if front_of and len(valid) else None, constrained=constrained,
    )


def build_report(source, model: str | None = None, z: float = stats.Z95, seed: int = 0,
                 constraints: tuple[pareto.Constraint | str, ...] = ()) -> Report:
    """Everything the report says, from any input `load_trials` accepts; restricted to one model if given;
    `constraints` ("decode_speedup>=1.3" or pareto.Constraint): also each model's best configuration meeting them."""
    try:
        constraints = tuple(c if isinstance(c, pareto.Constraint) else pareto.parse_constraint(c) for c in constraints)
    except ValueError as error:
        raise ReportError(f"--constraint: {error}") from None
    table = load_trials(source)
    if model is not None:
        table = table.for_model(model)
    objective = table.objective
    models = {m: model_report(table, m, z, seed, objective, constraints) for m in table.models}
    valid = table.valid
    invalid_counts = table.invalid.groupby("model").size().to_dict() if len(table.invalid) else {}
    notes = []
    if table.superseded:
        notes.append(f"{table.superseded} folder(s) of trials that ran again after a resume were superseded "
                     "by the trial's later run and left out")
    unattributed = int(table.trials["model"].isna().sum())
    if unattributed:
        notes.append(f"{unattributed} trial(s) recorded no model and appear only in the invalid-trial count")
    return Report(
        source=table.source,
        table=table,
        models=models,
        cross=stats.cross_model(valid, invalid_counts, objective),
        value_of_search=stats.value_of_search(valid, objective),
        key=stats.key_figures(valid, table.tasks, len(table.trials)),
        z=z,
        notes=notes,
        objective=objective,
    )


# ---------------------------------------------------------------- text and Markdown


def _fmt(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.{digits}f}"
    return str(value)


def _sig(value) -> str:
    """4 significant digits: gradient statistics span many orders of magnitude."""
    return f"{value:.4g}" if isinstance(value, float) and math.isfinite(value) else _fmt(value)


def _frame(table: pd.DataFrame | None, index_name: str | None = None) -> pd.DataFrame | None:
    if table is None:
        return None
    table = table.reset_index() if index_name else table
    return table.rename(columns={"index": index_name}) if index_name else table


def sections(report: Report) -> list[tuple[str, list]]:
    """The report as (title, blocks) pairs, a block being a line of text or a DataFrame; both renderers use it."""
    out: list[tuple[str, list]] = []
    z = report.z
    metric = report.objective.metric
    mean = f"mean {metric}"
    center = "geometric mean ppl" if report.objective.center == "gmean" else mean
    columns = {"mean": mean, "gmean": "geo-mean ppl", "count": "trials"}
    for name, m in report.models.items():
        head = [
            f"Trials: {m.trials}, valid: {len(m.valid)}, invalid: {len(m.invalid)}; "
            f"ranked by {metric} ({'lower' if report.objective.ascending else 'higher'} is better), the sweep's metric"
        ]
        if len(m.invalid):
            head += [
                "Invalid trials (left out of every statistic):",
                m.invalid[[c for c in ("trial_id", *CONFIG_COLUMNS[1:4], "reason") if c in m.invalid]],
            ]
        out.append((f"{name.upper()}", head))
        if m.valid.empty:
            out.append(("No valid trials", ["Nothing could be computed for this model."]))
            continue
        methods = m.methods["table"].rename(columns=columns)
        out.append(
            (
                "1. Pruning methods",
                [
                    _frame(methods, "method"),
                    f"Best method: {str(m.methods['best_method']).upper()} (its best trial: {metric} "
                    f"{_fmt(m.methods['best_value'])}); "
                    f"best by {center}: {str(m.methods['best_method_by_mean']).upper()}",
                ],
            )
        )
        blocks: list = []
        for label, impact in (("taylor_seq_len", m.seq_len), ("taylor_num_samples", m.num_samples)):
            blocks += [f"By {label}:", _frame(impact["table"].rename(columns=columns), label),
                       f"Best {label}: {impact['best_value']} ({center} {_fmt(impact['best_mean'])})"]
        importance = m.importance
        if importance.get("importances"):
            blocks.append(
                f"Hyperparameter importance (Optuna fANOVA, share of {importance.get('of', metric)}'s variance): "
                + ", ".join(f"{k} {v:.2f}" for k, v in importance["importances"].items())
            )
        else:
            blocks.append(f"Hyperparameter importance: undefined ({importance.get('reason')})")
        out.append(("2. Hyperparameters", blocks))
        grad = pd.DataFrame(
            [
                {
                    "statistic": c.x,
                    "r": c.r,
                    "p": c.p,
                    "n": c.n,
                    "strength or reason": c.strength or f"undefined: {c.reason}",
                }
                for c in m.gradient
            ]
        )
        out.append(
            (
                f"3. Gradient statistics vs {metric}",
                [
                    grad,
                    "Strength by |r|: < 0.3 negligible, 0.3-0.5 weak, 0.5-0.7 moderate, >= 0.7 strong (Pearson; rows "
                    "with inf or missing values left out and counted).",
                ],
            )
        )
        extreme = m.extreme
        out.append(("4. Extreme-pruning layers", [
            f"Correlation with {metric}: {extreme['correlation'].describe()}",
            _frame(extreme["table"].rename(columns={"mean": mean, "count": "trials"}), "layers"),
        ]))
        out.append(("5. Perplexity vs acc_mean", [f"Correlation: {m.ppl.describe()}"]))
        out.append(("6. Best configuration", _best_blocks(m, z)))
        seeds = m.seeds
        out.append(
            (
                "7. Calibration-seed spread",
                [seeds["reason"]]
                if seeds.get("reason")
                else [
                    f"Mean between-seed std of {metric}: {seeds['mean_std']:.4f}",
                    _frame(seeds["table"].rename(columns={"count": "seeds"}), None).reset_index(),
                ],
            )
        )
        held = m.heldout
        out.append(
            (
                "8. Held-out selection",
                [f"Not computed: {held['reason']}"]
                if held.get("reason")
                else [
                    f"Chosen on the selection half: {held['chosen']} {held['config']}",
                    f"acc on the selection half {held['selection_acc']:.4f}, on the held-out half "
                    f"{held['heldout_acc']:.4f} "
                    f"(optimism of picking by the reported numbers: {held['optimism']:+.4f}); best held-out acc of "
                    f"any trial {held['best_heldout_acc']:.4f}",
                ],
            )
        )
        if m.speed is not None:
            out.append(("9. Speed vs quality", [
                "Measured on each trial's device against the unpruned model: speedups of prefill, decode at batch 1 "
                "and at the larger batch (> 1 = faster), memory of weights and KV cache (< 1 = smaller).",
                m.speed,
            ]))
        if m.front is not None:
            out.append(("10. Pareto front", _front_blocks(m)))
        if m.constrained is not None:
            out.append(("11. Best under constraints", _constrained_blocks(m)))
    out.append(("Cross-model comparison", _cross_blocks(report)))
    return out


def _varied(table: pd.DataFrame) -> list[str]:
    """The search dimensions that take more than one value in `table`."""
    return [c for c in stats.searched(table) if table[c].astype(str).nunique() > 1]


def _front_blocks(m: ModelReport) -> list:
    table, objectives = m.front, m.front_objectives
    metrics = [o.metric for o in objectives]
    shown = ["point", *_varied(table), *(c for metric in metrics for c in (metric, f"{metric}_se")), "seeds"]
    front, dominated = table[table["on_front"]], table[~table["on_front"]]
    left_out = table.attrs.get("left_out", 0)
    return [
        "Objectives: " + ", ".join(f"{o.metric} ({'lower' if o.ascending else 'higher'} is better)" for o in objectives)
        + ". A point is a configuration (its first trial's id): the mean over its calibration seeds, and its "
        "uncertainty (_se: the seeds' spread and lm-eval's item stderr in quadrature; NaN where neither was measured).",
        f"On the front: {len(front)} of {len(table)} configurations"
        + (f" ({left_out} left out: an objective not reported)" if left_out else ""),
        front[shown].reset_index(drop=True),
        "Dominated configurations, the number of points that dominate each and the first of them (every one in "
        "pareto_front.csv):" if len(dominated) else "No point is dominated.",
        *([dominated[shown[:-1]].assign(
            dominated_by=[_first(ids.split(";")) for ids in dominated["dominated_by"]]).reset_index(drop=True)]
          if len(dominated) else []),
    ]


def _first(ids: list[str], shown: int = 2) -> str:
    """`n: a, b, ...`: how many, and the first `shown` of them."""
    return f"{len(ids)}: {', '.join(ids[:shown])}{', ...' if len(ids) > shown else ''}"


def _constrained_blocks(m: ModelReport) -> list:
    c = m.constrained
    head = f"Constraints: {', '.join(c['constraints'])} (on each configuration's mean over its seeds)"
    if c["best"] is None:
        return [head, f"None: {c['reason']} ({c['satisfying']} of {c['of']} configurations meet them)."]
    best = c["best"]
    config = ", ".join(f"{k} {stats.plain(best[k])}" for k in _varied(m.valid))  # what the search varied
    return [head, f"{c['satisfying']} of {c['of']} configurations meet them; the best by {m.objective.metric}: "
            f"{best['point']} ({config}) with {m.objective.metric} {_fmt(best[m.objective.metric])}"]


def _best_blocks(m: ModelReport, z: float) -> list:
    b = m.best
    ci = stats.confidence_interval(
        float(b["acc_mean"]), m.best_stderr if m.best_stderr is not None else float("nan"), z
    )
    ci_text = f", {stats.coverage(z):.0%} interval [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else ""
    blocks = [
        f"Trial {b['trial_id']}: method {str(b['pruning_method']).upper()}, taylor_seq_len {b['taylor_seq_len']}, "
        f"taylor_num_samples {b['taylor_num_samples']}, seed {_fmt(b.get('seed'))}",
        f"acc_mean {float(b['acc_mean']):.4f} ± {_fmt(m.best_stderr)} (stderr){ci_text}; ppl {_fmt(b.get('ppl'), 2)}"
        + (f" (ranked by {m.objective.metric})" if m.objective.metric != "acc_mean" else ""),
        "Diagnostics: "
        + ", ".join(
            f"{k} {_sig(b.get(k))}" for k in ("params_count", "pruning_ratio", *GRAD_COLUMNS, "extreme_pruning_layers")
        ),
    ]
    rows = []
    for t in m.tasks:
        acc, se = b.get(f"acc_{t}"), b.get(f"acc_{t}_stderr")
        n = b.get(f"acc_{t}_n")
        if n is not None and not pd.isna(n):  # Wilson over the task's items; older trials lack n: normal approximation
            interval = stats.wilson_interval(float(acc), int(n), z)
        else:
            interval = stats.confidence_interval(
                float(acc), float(se) if se is not None and not pd.isna(se) else float("nan"), z
            )
        rows.append({"task": t, "acc": acc, "stderr": se, "n": None if n is None or pd.isna(n) else int(n),
                     "ci_low": interval[0] if interval else None, "ci_high": interval[1] if interval else None})
    blocks.append(pd.DataFrame(rows))
    lead = m.lead
    if lead.runner_up is None:
        blocks.append(f"Lead over the runner-up: undefined ({lead.reason})")
    elif m.objective.metric != "acc_mean":
        blocks.append(
            f"Lead over the runner-up {lead.runner_up}: {lead.difference:.4g} {m.objective.metric}; {lead.reason}"
        )
    elif lead.exceeds_uncertainty is None:
        blocks.append(
            f"Lead over the runner-up {lead.runner_up}: {lead.difference:+.4f}; uncertainty unknown ({lead.reason})"
        )
    else:
        verdict = "exceeds" if lead.exceeds_uncertainty else "does NOT exceed"
        blocks.append(f"Lead over the runner-up {lead.runner_up}: {lead.difference:+.4f} ± {lead.stderr:.4f}; "
                      f"{verdict} {z:.2f} standard errors")
        blocks.append(
            f"Statistically tied with the best: {len(lead.tied_with_best)} trial(s)"
            + (
                f": {', '.join(lead.tied_with_best[:10])}{' ...' if len(lead.tied_with_best) > 10 else ''}"
                if lead.tied_with_best
                else ""
            )
        )
    return blocks


def _cross_blocks(report: Report) -> list:
    if report.cross.empty:
        return [f"No valid trials among {len(report.table.trials)}: nothing to compare."] + report.notes
    blocks: list = [report.cross.drop(columns=["trial_id"])]
    best = report.overall_best
    blocks.append(
        f"Overall best by {report.objective.metric}: {best['model'].upper()} with {str(best['best_method']).upper()}, "
        f"acc {best['best_acc']:.4f}, ppl {_fmt(best['best_ppl'], 2)}"
    )
    if len(report.models) > 1:
        blocks += [
            f"Value of the search (each model's best configuration applied to every model; loss = how much worse its "
            f"{report.objective.metric} is than the model's own best):",
            report.value_of_search,
        ]
    k = report.key
    blocks.append(
        f"Scale: {k['trials']} trials ({k['valid_trials']} valid), {k.get('models')} model(s), {k.get('methods')} "
        f"method(s), "
        f"{k.get('task_evaluations')} task evaluations; trial time {_fmt(k.get('trial_hours'), 2)} h"
    )
    blocks.append(f"acc_mean over valid trials: max {_fmt(k.get('acc_max'))}, min {_fmt(k.get('acc_min'))}, "
                  f"median {_fmt(k.get('acc_median'))}, mean {_fmt(k.get('acc_mean'))} ± {_fmt(k.get('acc_std'))}")
    if k.get("ppl_median") is not None:
        blocks.append(f"ppl over valid trials: min {_fmt(k.get('ppl_min'), 2)}, median {_fmt(k.get('ppl_median'), 2)}, "
                      f"max {_fmt(k.get('ppl_max'), 2)}")
    return blocks + report.notes


def _text_table(df: pd.DataFrame) -> str:
    return df.to_string(index=False, float_format=lambda v: _fmt(float(v)), na_rep="-")


def _markdown_table(df: pd.DataFrame) -> str:
    cells = [
        [_fmt(v) if isinstance(v, float) else ("-" if v is None else str(v)) for v in row]
        for row in df.itertuples(index=False)
    ]
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    return "\n".join(lines + ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells])


def render_text(report: Report) -> str:
    lines = [f"taylor_tune analysis report: {report.source}"]
    for title, blocks in sections(report):
        top = not title[0].isdigit() and title not in ("No valid trials",)
        rule = "=" * 80 if top else "-" * 80
        lines += ["", rule, title, rule]
        lines += [_text_table(b) if isinstance(b, pd.DataFrame) else b for b in blocks if b is not None]
    return "\n".join(lines) + "\n"


def render_markdown(report: Report) -> str:
    lines = ["# taylor_tune analysis report", "", f"Source: `{report.source}`"]
    for title, blocks in sections(report):
        top = not title[0].isdigit() and title not in ("No valid trials",)
        lines += ["", f"{'##' if top else '###'} {title}", ""]
        for b in blocks:
            if b is not None:
                lines += [_markdown_table(b) if isinstance(b, pd.DataFrame) else b, ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- files


def folder_name(model: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "--", model)


def _records(value):
    """DataFrames (at any depth) as lists of records; the rest as it is, for jsonio."""
    if isinstance(value, dict):
        return {k: _records(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_records(v) for v in value]
    if isinstance(value, pd.DataFrame):
        # a grouped table's keys are its index (a MultiIndex has names but no .name): they go into each record
        named = any(name is not None for name in value.index.names)
        return value.reset_index().to_dict(orient="records") if named else value.to_dict(orient="records")
    return value


def _write_json(path: Path, data) -> Path:
    return write_json(path, _records(data))


def best_config_dict(m: ModelReport) -> dict:
    b = m.best
    keep = [c for c in b.index if not c.startswith("config/") and c not in ("valid", "reason")]
    return {
        "model": m.model,
        "trial_id": b["trial_id"],
        "objective": {"metric": m.objective.metric, "mode": m.objective.mode},
        "acc_mean_stderr": m.best_stderr,
        "config": {k: b.get(k) for k in ("model", *stats.searched(b.to_frame().T), "seed")},
        "metrics": {k: b[k] for k in keep},
        "lead": m.lead.to_dict(),
    }


def method_comparison_dict(m: ModelReport) -> dict:
    table = m.methods["table"]
    best_per_method = {
        method: stats.best_trial(group, m.objective) for method, group in m.valid.groupby("pruning_method")
    }
    return {
        "model": m.model,
        "metric": m.objective.metric,
        "best_method": m.methods["best_method"],
        "best_acc": m.methods["best_acc"],
        "best_value": m.methods["best_value"],
        "best_method_by_mean": m.methods["best_method_by_mean"],
        "methods": {
            method: {
                **row.to_dict(),
                "best_trial": best_per_method[method]["trial_id"],
                "best_config": {k: best_per_method[method][k] for k in CONFIG_COLUMNS},
            }
            for method, row in table.iterrows()
        },
        "seq_len": {"table": m.seq_len["table"], "best_value": m.seq_len["best_value"]},
        "num_samples": {"table": m.num_samples["table"], "best_value": m.num_samples["best_value"]},
        "gradient_correlations": [c.to_dict() for c in m.gradient],
        "extreme_pruning_layers": {"correlation": m.extreme["correlation"].to_dict(), "table": m.extreme["table"]},
        "ppl_correlation": m.ppl.to_dict(),
        "hyperparameter_importance": m.importance,
        "seed_spread": {"reason": m.seeds.get("reason"), "table": m.seeds.get("table")},
        "heldout_selection": m.heldout,
    }


def _leaves(trial_dir: Path, name: str) -> bool:
    """Whether a local trial folder's file is a symbolic link to somewhere outside the folder."""
    path = trial_dir / name
    return path.is_symlink() and not path.resolve().is_relative_to(trial_dir.resolve())


def _refuse_links(out: Path) -> None:
    """Writing into a folder that holds symbolic links would write through them, to wherever they point."""
    for path in (out, *out.rglob("*")) if out.is_dir() else (out,):
        if path.is_symlink():
            raise ReportError(f"--output: {path} is a symbolic link, and the report would write through it; "
                              "write the report to a fresh folder")


def _copy_artifacts(report_dir: Path, m: ModelReport, written: list[Path], filesystem=None) -> None:
    """The best trial's artifacts (reference/003's best_<model>/ layout) and its three per-layer plots."""
    folder = report_dir / f"best_{folder_name(m.model)}"
    written.append(_write_json(folder / "best_config.json", best_config_dict(m)))
    trial_dir = m.best.get("output_dir")
    texts, leaving = {}, []
    if isinstance(trial_dir, str):
        filesystem, root = open_filesystem(trial_dir, filesystem)
        texts = {name: read_text(filesystem, f"{root.rstrip('/')}/{name}") for name in ARTIFACTS}
        leaving = [name for name in ARTIFACTS if _leaves(Path(root), name)] if "://" not in trial_dir else []
        texts |= dict.fromkeys(leaving)  # a link out of the trial folder is not the trial's: never copied
    (folder / "artifacts").mkdir(parents=True, exist_ok=True)
    missing = [name for name, text in texts.items() if text is None] if texts else list(ARTIFACTS)
    for name, text in texts.items():
        if text is not None:
            (folder / "artifacts" / name).write_text(text)
            written.append(folder / "artifacts" / name)
    if missing:
        links = f" ({', '.join(leaving)}: a symbolic link out of the trial folder, not copied)" if leaving else ""
        (folder / "MISSING.txt").write_text(f"not found in {trial_dir}: {', '.join(missing)}{links}\n")
        written.append(folder / "MISSING.txt")
    if texts.get("evaluation.json"):
        (folder / "evaluation").mkdir(exist_ok=True)
        shutil.copyfile(folder / "artifacts" / "evaluation.json", folder / "evaluation" / "evaluation_results.json")
        written.append(folder / "evaluation" / "evaluation_results.json")
    try:
        summary = json.loads(texts["pruning_summary.json"]) if texts.get("pruning_summary.json") else None
        layers = json.loads(texts["layer_analysis.json"]) if texts.get("layer_analysis.json") else None
    except json.JSONDecodeError:
        summary = layers = None
    if summary is not None:
        written.append(_write_json(folder / "analysis" / "gradient_diagnosis.json", {
            k: summary.get(k) for k in ("grad_mean_ratio", "grad_norm_ratio", "grad_mean_range", "grad_norm_range",
                                        "layer_grad_mean", "layer_grad_norm", "notes")}))
    if layers is not None:
        written.append(_write_json(folder / "analysis" / "pruning_comparison.json", layers))
        profile = plots.layer_profile(layers, f"{m.model} best trial")
        (folder / "visualization").mkdir(exist_ok=True)
        written.append(_write_json(folder / "visualization" / "layer_profile.json", profile.to_dict()))
        written += plots.render_layer_plots(profile, folder / "visualization").values()


def write_report(report: Report, output: str | Path) -> list[Path]:
    """Write every file of the report under `output`; returns the paths written."""

    out = Path(output)
    if out.exists() and not out.is_dir() and not out.is_symlink():
        raise ReportError(f"--output: {out} is a file, not a folder")
    _refuse_links(out)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    trials = report.table.trials
    for name, m in report.models.items():
        folder = out / f"consolidated_{folder_name(name)}"
        folder.mkdir(exist_ok=True)
        rows = trials[trials["model"] == name].drop(columns=[c for c in trials if c.startswith("config/")])
        rows = rows.assign(acc_mean_stderr=m.valid["acc_mean_stderr"]).sort_values(
            report.objective.metric, ascending=report.objective.ascending, na_position="last")
        rows.to_csv(folder / "all_methods_results.csv", index=False)
        written.append(folder / "all_methods_results.csv")
        if m.speed is not None:
            m.speed.to_csv(folder / "speed_quality.csv", index=False)
            written.append(folder / "speed_quality.csv")
        if m.front is not None:
            m.front.to_csv(folder / "pareto_front.csv", index=False)
            written.append(folder / "pareto_front.csv")
        if m.constrained is not None:
            written.append(_write_json(folder / "best_under_constraints.json", m.constrained))
        if m.best is not None:
            written.append(_write_json(folder / "global_best_config.json", best_config_dict(m)))
            written.append(_write_json(folder / "method_comparison.json", method_comparison_dict(m)))
            _copy_artifacts(out, m, written, report.table.filesystem)
    report.table.invalid.to_csv(out / "invalid_trials.csv", index=False)
    written.append(out / "invalid_trials.csv")
    written.append(_write_json(out / "cross_model_comparison.json", {
        "models": report.cross, "overall_best": report.overall_best, "value_of_search": report.value_of_search,
        "key_figures": report.key, "notes": report.notes}))
    for path, text in (
        (out / "final_analysis_report.txt", render_text(report)),
        (out / "final_analysis_report.md", render_markdown(report)),
    ):
        path.write_text(text)
        written.append(path)

    valid = report.table.valid
    paper, figures = out / "paper", out / "figures"
    paper.mkdir(exist_ok=True)
    figures.mkdir(exist_ok=True)
    with_best = [m for m in report.models.values() if m.best is not None]
    tables = {
        "table1_best_configs.tex": latex.best_configs_table(report.cross, objective=report.objective),
        "table2_task_accuracy.tex": latex.task_table(
            [m.best.to_dict() for m in with_best], report.table.tasks, report.objective
        ),
        "table3_method_comparison.tex": latex.method_table(
            {m.model: m.methods["table"] for m in with_best}, report.objective
        ),
        "table4_seq_len.tex": latex.seq_len_table({m.model: m.seq_len["table"] for m in with_best}, report.objective),
    }
    for name, text in {**tables, "tables.tex": latex.document(list(tables.values()))}.items():
        (paper / name).write_text(text)
        written.append(paper / name)
    for m in with_best:
        data = plots.heatmap_data(valid, m.model, report.objective.metric)
        written.append(_write_json(figures / f"heatmap_{folder_name(m.model)}.json", data.to_dict()))
        plots.render_heatmap(data, figures / f"heatmap_{folder_name(m.model)}.png")
        written.append(figures / f"heatmap_{folder_name(m.model)}.png")
    for m in report.models.values():
        if m.speed is not None:
            data = plots.speed_quality_data(m.speed, m.model)
            written.append(_write_json(figures / f"speed_quality_{folder_name(m.model)}.json", data.to_dict()))
            plots.render_speed_quality(data, figures / f"speed_quality_{folder_name(m.model)}.png")
            written.append(figures / f"speed_quality_{folder_name(m.model)}.png")
        if m.front is not None and len(m.front):
            data = plots.pareto_data(m.front, m.model, m.front_objectives)
            written.append(_write_json(figures / f"pareto_{folder_name(m.model)}.json", data.to_dict()))
            plots.render_pareto(data, figures / f"pareto_{folder_name(m.model)}.png")
            written.append(figures / f"pareto_{folder_name(m.model)}.png")
    if with_best:
        bars = plots.method_bars(valid, report.objective.metric)
        written.append(_write_json(figures / "methods_by_models.json", bars.to_dict()))
        plots.render_method_bars(bars, figures / "methods_by_models.png")
        written.append(figures / "methods_by_models.png")
    return written
