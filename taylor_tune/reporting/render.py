"""A Report printed: `render_text` and `render_markdown`, both from `sections` (title, blocks), one function per
section. Pure: returns strings, writes nothing."""

from __future__ import annotations

import math

import pandas as pd

from taylor_tune.reporting import stats
from taylor_tune.reporting.build import ModelReport, Report
from taylor_tune.reporting.frame import GRAD_COLUMNS
from taylor_tune.schema import CONFIG_COLUMNS


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


def _model_head(report: Report, m: ModelReport) -> tuple[str, list]:
    metric = report.objective.metric
    head = [
        f"Trials: {m.trials}, valid: {len(m.valid)}, invalid: {len(m.invalid)}; "
        f"ranked by {metric} ({'lower' if report.objective.ascending else 'higher'} is better), the sweep's metric"
    ]
    if len(m.invalid):
        head += [
            "Invalid trials (left out of every statistic):",
            m.invalid[[c for c in ("trial_id", *CONFIG_COLUMNS[1:4], "reason") if c in m.invalid]],
        ]
    return f"{m.model.upper()}", head


def _names(report: Report) -> tuple[str, str, dict]:
    """The column names of the sections' tables: the mean of the metric, the centre the report ranks by."""
    mean = f"mean {report.objective.metric}"
    center = "geometric mean ppl" if report.objective.center == "gmean" else mean
    return mean, center, {"mean": mean, "gmean": "geo-mean ppl", "count": "trials"}


def _methods_section(report: Report, m: ModelReport) -> tuple[str, list]:
    _, center, columns = _names(report)
    methods = m.methods["table"].rename(columns=columns)
    return (
        "1. Pruning methods",
        [
            _frame(methods, "method"),
            f"Best method: {str(m.methods['best_method']).upper()} (its best trial: {report.objective.metric} "
            f"{_fmt(m.methods['best_value'])}); "
            f"best by {center}: {str(m.methods['best_method_by_mean']).upper()}",
            *_paired_blocks(m, "method", str(m.methods["best_method"]).upper(), report.z),
        ],
    )


def _paired_blocks(m: ModelReport, name: str, best: str, z: float) -> list:
    """A section's levels against its best, paired by configuration on the same items (stats.paired_levels)."""
    levels = m.paired.get(name)
    if levels is None:
        return []
    return [f"Against {best}, paired by configuration on the same items (acc_mean difference, task-stratified "
            f"standard error; separated: beyond {z:.2f} of them):", levels.rename(columns={"level": name})]


def _hyperparameters_section(report: Report, m: ModelReport) -> tuple[str, list]:
    _, center, columns = _names(report)
    blocks: list = []
    for label, impact in (("taylor_seq_len", m.seq_len), ("taylor_num_samples", m.num_samples)):
        blocks += [f"By {label}:", _frame(impact["table"].rename(columns=columns), label),
                   f"Best {label}: {impact['best_value']} ({center} {_fmt(impact['best_mean'])})",
                   *_paired_blocks(m, label, str(impact["best_value"]), report.z)]
    importance = m.importance
    if importance.get("importances"):
        blocks.append(
            f"Hyperparameter importance (Optuna fANOVA, share of {importance.get('of', report.objective.metric)}'s "
            "variance): " + ", ".join(f"{k} {v:.2f}" for k, v in importance["importances"].items())
        )
    else:
        blocks.append(f"Hyperparameter importance: undefined ({importance.get('reason')})")
    return "2. Hyperparameters", blocks


def _gradient_section(report: Report, m: ModelReport) -> tuple[str, list]:
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
    return (
        f"3. Gradient statistics vs {report.objective.metric}",
        [
            grad,
            "Strength by |r|: < 0.3 negligible, 0.3-0.5 weak, 0.5-0.7 moderate, >= 0.7 strong (Pearson; rows "
            "with inf or missing values left out and counted).",
        ],
    )


def _extreme_section(report: Report, m: ModelReport) -> tuple[str, list]:
    mean, _, _ = _names(report)
    extreme = m.extreme
    return ("4. Extreme-pruning layers", [
        f"Correlation with {report.objective.metric}: {extreme['correlation'].describe()}",
        _frame(extreme["table"].rename(columns={"mean": mean, "count": "trials"}), "layers"),
    ])


def _ppl_section(report: Report, m: ModelReport) -> tuple[str, list]:
    return "5. Perplexity vs acc_mean", [f"Correlation: {m.ppl.describe()}"]


def _best_section(report: Report, m: ModelReport) -> tuple[str, list]:
    return "6. Best configuration", _best_blocks(m, report.z)


def _seeds_section(report: Report, m: ModelReport) -> tuple[str, list]:
    seeds = m.seeds
    return (
        "7. Calibration-seed spread",
        [seeds["reason"]]
        if seeds.get("reason")
        else [
            f"Mean between-seed std of {report.objective.metric}: {seeds['mean_std']:.4f}",
            _frame(seeds["table"].rename(columns={"count": "seeds"}), None).reset_index(),
        ],
    )


def _heldout_section(report: Report, m: ModelReport) -> tuple[str, list]:
    held = m.heldout
    return (
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


def _speed_section(report: Report, m: ModelReport) -> tuple[str, list] | None:
    if m.speed is None:
        return None
    return ("9. Speed vs quality", [
        "Measured on each trial's device against the unpruned model: speedups of prefill, decode at batch 1 "
        "and at the larger batch (> 1 = faster), memory of weights and KV cache (< 1 = smaller). Where the trials "
        "timed the two models in turn (paired), decode_speedup_low / _high are the 95% interval from the pairs.",
        m.speed,
    ])


def _front_section(report: Report, m: ModelReport) -> tuple[str, list] | None:
    return None if m.front is None else ("10. Pareto front", _front_blocks(m))


def _constrained_section(report: Report, m: ModelReport) -> tuple[str, list] | None:
    return None if m.constrained is None else ("11. Best under constraints", _constrained_blocks(m))


def _recovery_section(report: Report, m: ModelReport) -> tuple[str, list] | None:
    if m.recovery is None:
        return None
    lines = ["Held-out perplexity (the recovery's held-out windows) before and after recovery, per configuration "
             "(mean over seeds), beside the sweep's metric (after recovery). Kendall's tau-b compares the "
             "configurations' rankings before and after (1: recovery changes no ranking)."]
    rankings = m.recovery["rankings"]
    varied = [k for k in rankings[0]["recovery"] if len({str(r["recovery"][k]) for r in rankings}) > 1]
    for r in rankings:
        setting = ", ".join(f"{k}={r['recovery'][k]}" for k in varied) or "every recovered trial"
        tau = (f"Kendall's tau-b {r['tau']:.3f} (95% bootstrap interval {_fmt(r['ci95'][0], 3)} to "
               f"{_fmt(r['ci95'][1], 3)}, {r['configurations']} configurations)" if "tau" in r else r["reason"])
        best = (f"best before and after: {r['best_before']}" if r["same_best"] else
                f"best before: {r['best_before']}; best after: {r['best_after']} (recovery changes the best)")
        lines.append(f"{setting}: {tau}; {best}")
        on = r.get("on_metric")
        if on is not None:
            tau = (f"Kendall's tau-b {on['tau']:.3f} (95% bootstrap interval {_fmt(on['ci95'][0], 3)} to "
                   f"{_fmt(on['ci95'][1], 3)})" if "tau" in on else "fewer than three configurations")
            best = (f"best before and after: {on['best_before']}" if on["same_best"] else
                    f"best before: {on['best_before']}; best after: {on['best_after']} (recovery changes the best)")
            lines.append(f"{setting}, on {on['metric']} (evaluated before and after): {tau}; {best}")
    return ("12. Recovery: before and after", [*lines, m.recovery["table"]])


# A model's sections after its head, in order; a section that returns None has nothing to say for this report.
MODEL_SECTIONS = (_methods_section, _hyperparameters_section, _gradient_section, _extreme_section, _ppl_section,
                  _best_section, _seeds_section, _heldout_section, _speed_section, _front_section,
                  _constrained_section, _recovery_section)


def sections(report: Report) -> list[tuple[str, list]]:
    """The report as (title, blocks) pairs, a block being a line of text or a DataFrame; both renderers use it."""
    out: list[tuple[str, list]] = []
    for m in report.models.values():
        out.append(_model_head(report, m))
        if m.valid.empty:
            out.append(("No valid trials", ["Nothing could be computed for this model."]))
            continue
        out += [s for s in (section(report, m) for section in MODEL_SECTIONS) if s is not None]
    out.append(("Cross-model comparison", _cross_blocks(report)))
    return out


def _varied(table: pd.DataFrame) -> list[str]:
    """The search dimensions that take more than one value in `table`."""
    return [c for c in stats.searched(table) if table[c].astype(str).nunique() > 1]


def _front_blocks(m: ModelReport) -> list:
    table, objectives = m.front, m.front_objectives
    metrics = [o.metric for o in objectives]
    family = ["family"] if "family" in table and table["family"].nunique() > 1 else []
    shown = ["point", *family, *_varied(table), *(c for metric in metrics for c in (metric, f"{metric}_se")), "seeds"]
    front, dominated = table[table["on_front"]], table[~table["on_front"]]
    left_out = table.attrs.get("left_out", 0)
    return [
        "Objectives: " + ", ".join(f"{o.metric} ({'lower' if o.ascending else 'higher'} is better)" for o in objectives)
        + ". A point is a configuration (its first trial's id): the mean over its calibration seeds, and its "
        "uncertainty (_se: the seeds' spread and the measurement's own error, lm-eval's item stderr or the timing's, "
        "in quadrature; NaN where neither was measured).",
        f"On the front: {len(front)} of {len(table)} configurations"
        + (f" ({left_out} left out: an objective not reported)" if left_out else ""),
        front[shown].reset_index(drop=True),
        "Dominated configurations, the number of points that dominate each and the first of them (every one in "
        "pareto_front.csv):" if len(dominated) else "No point is dominated.",
        *([dominated[shown[:-1]].assign(
            dominated_by=[_first(ids.split(";")) for ids in dominated["dominated_by"]]).reset_index(drop=True)]
          if len(dominated) else []),
        *_tied_lines(dominated, table.attrs),
    ]


def _tied_lines(dominated: pd.DataFrame, attrs: dict) -> list[str]:
    """The dominated points whose every dominator leads within the uncertainty: off the front by the means only; and
    how the leads were judged (pareto.paired_resolved)."""
    if "tied_with" not in dominated:
        return []
    how = (f"Leads judged on paired intervals (the same items, windows, or each point's interleaved timing) for "
           f"{attrs.get('paired', 0)} domination(s), the independent bound for the rest; separated by the paired "
           f"intervals only: {attrs.get('separated_by_pairing', 0)}.")
    tied = dominated[[bool(t) and set(t.split(";")) == set(d.split(";"))
                      for t, d in zip(dominated["tied_with"], dominated["dominated_by"])]]
    if tied.empty:
        return ["Every dominated point is behind a point that dominates it by more than the uncertainty (95%) in "
                "some objective. " + how]
    return [f"Tied with the front: {len(tied)} dominated point(s) are within the uncertainty (95%) of every point "
            "that dominates them, so their place off the front is not resolved: "
            + ", ".join(f"{p} (by {_first(t.split(';'))})" for p, t in zip(tied["point"], tied["tied_with"]))
            + ". " + how]


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
        if m.task_tests:  # against the runner-up on the same items: the exact McNemar test
            test = m.task_tests.get(t)
            rows[-1] |= {"only_best": None, "only_runner_up": None, "mcnemar_p": None} if test is None else {
                "only_best": test["only_a"], "only_runner_up": test["only_b"], "mcnemar_p": test["p"]}
    blocks.append(pd.DataFrame(rows))
    if m.task_tests:
        blocks.append(f"Per task against the runner-up {m.lead.runner_up} on the same items (exact McNemar): items "
                      f"only the best answers right, only the runner-up, and the two-sided p")
    lead = m.lead
    if lead.runner_up is None:
        blocks.append(f"Lead over the runner-up: undefined ({lead.reason})")
    elif m.objective.metric != "acc_mean" and lead.exceeds_uncertainty is None:
        blocks.append(
            f"Lead over the runner-up {lead.runner_up}: {lead.difference:.4g} {m.objective.metric}; {lead.reason}"
        )
    elif lead.exceeds_uncertainty is None:
        blocks.append(
            f"Lead over the runner-up {lead.runner_up}: {lead.difference:+.4f}; uncertainty unknown ({lead.reason})"
        )
    else:
        verdict = "exceeds" if lead.exceeds_uncertainty else "does NOT exceed"
        unit = f" {lead.unit}" if lead.unit else ""
        blocks.append(f"Lead over the runner-up {lead.runner_up}: {lead.difference:+.4f}{unit} ± {lead.stderr:.4f}; "
                      f"{verdict} {z:.2f} standard errors")
        blocks.append(
            f"Statistically tied with the best: {len(lead.tied_with_best)} trial(s)"
            + (
                f": {', '.join(lead.tied_with_best[:10])}{' ...' if len(lead.tied_with_best) > 10 else ''}"
                if lead.tied_with_best
                else ""
            )
        )
        blocks.append(_pairing_line(lead))
    return blocks


def _pairing_line(lead) -> str:
    """How the ties were judged: paired on the same items where both trials kept their outcomes."""
    if lead.unit == "log ppl":
        return (f"Ties judged paired on the same perplexity windows for {lead.paired} trial(s); the others kept no "
                f"windows of the best's text and are not judged")
    if not lead.paired:
        return ("Ties judged by the independent bound (no trial kept its items' outcomes, or none scored the best's "
                "items)")
    return (f"Ties judged paired on the same items for {lead.paired} trial(s) (the rest by the independent bound); "
            f"separated by the paired test only: {lead.separated_by_pairing}")


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
