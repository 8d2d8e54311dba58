"""The paper's LaTeX tables (Tables 1-4 of the source study) as booktabs strings, from report data; pure.

Only `booktabs` is needed (no multirow): a model's name stands on the first row of its block. The tables follow the
sweep's objective: ranked by an accuracy they are the paper's (means, highest in bold); ranked by perplexity they
show geometric means and the lowest value in bold, as the rest of the report does.
"""

from __future__ import annotations

import math

import pandas as pd

from taylor_tune.reporting.stats import ACCURACY, Objective, multiplicative

TASK_HEADERS = {"boolq": "BoolQ", "piqa": "PIQA", "hellaswag": "HellaS.", "winogrande": "WinoG.",
                "arc_easy": "ARC-E", "arc_challenge": "ARC-C", "openbookqa": "OBQA"}
_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
            "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def escape(text) -> str:
    return "".join(_ESCAPES.get(c, c) for c in str(text))


def number(value, digits: int = 4, bold: bool = False) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "--"
    text = f"{value:.{digits}f}"
    return rf"\textbf{{{text}}}" if bold else text


def _table(caption: str, label: str, spec: str, header: list[str], rows: list[list[str] | str]) -> str:
    lines = [r"\begin{table}[t]", r"\centering", rf"\caption{{{caption}}}", rf"\label{{{label}}}",
             rf"\begin{{tabular}}{{{spec}}}", r"\toprule", *header, r"\midrule"]
    lines += [row if isinstance(row, str) else " & ".join(row) + r" \\" for row in rows]
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines) + "\n"


def _words(objective: Objective) -> tuple[str, str, int, int]:
    """The metric's column label, its name in a caption, its digits, and the digits of a std or a seq_len mean."""
    if multiplicative(objective.metric):
        return "PPL", "wiki perplexity", 2, 2
    return "ACC", "mean zero-shot accuracy" if objective.metric == "acc_mean" else escape(objective.metric), 4, 3


def _best(values, objective: Objective):
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return (min if objective.ascending else max)(finite) if finite else None


def best_configs_table(cross: pd.DataFrame, sparsity: str = "", objective: Objective = ACCURACY) -> str:
    """Table 1: each model's best configuration; the best value of the ranked column in bold."""
    ranked = "best_ppl" if objective.metric == "ppl" else "best_acc"
    top = _best(cross[ranked].tolist(), objective)
    rows = [
        [
            escape(r.model),
            escape(str(r.best_method).capitalize()),
            escape(r.taylor_seq_len),
            escape(r.taylor_num_samples),
            number(r.best_acc, bold=ranked == "best_acc" and r.best_acc == top),
            number(r.best_ppl, 2, bold=ranked == "best_ppl" and r.best_ppl == top),
        ]
        for r in cross.itertuples()
    ]
    header = [
        r"\textbf{Model} & \textbf{Method} & \textbf{seq\_len} & \textbf{samples} & \textbf{Avg ACC} & \textbf{PPL} \\"
    ]
    caption = (f"Best pruning configuration found for each model{sparsity}, chosen by the "
               f"{'lowest' if objective.ascending else 'highest'} {_words(objective)[1]}.")
    return _table(caption, "tab:optimal_configs", "lccccc", header, rows)


def task_table(best_rows: list[dict], tasks: tuple[str, ...], objective: Objective = ACCURACY) -> str:
    """Table 2: per-task accuracy of each model's best configuration; the best of each column in bold."""
    columns = ["acc_mean", *[f"acc_{t}" for t in tasks]]
    tops = {c: max((r[c] for r in best_rows if r.get(c) is not None), default=None) for c in columns}
    rows = [
        [
            escape(r["model"]),
            escape(str(r["pruning_method"]).capitalize()),
            *[number(r.get(c), 3, bold=r.get(c) is not None and r.get(c) == tops[c]) for c in columns],
        ]
        for r in best_rows
    ]
    span = len(columns)
    header = [rf" & & \multicolumn{{{span}}}{{c}}{{\textbf{{Zero-shot accuracy}}}} \\",
              rf"\cmidrule(lr){{3-{2 + span}}}",
              r"\textbf{Model} & \textbf{Method} & \textbf{Avg} & "
              + " & ".join(rf"\textbf{{{escape(TASK_HEADERS.get(t, t))}}}" for t in tasks) + r" \\"]
    chosen = "" if objective.metric == "acc_mean" else f" (best by {_words(objective)[1]})"
    caption = f"Zero-shot accuracy of each model's best configuration{chosen}, task by task."
    return _table(caption, "tab:detailed_performance", "ll" + "c" * span, header, rows)


def method_table(methods: dict[str, pd.DataFrame], objective: Objective = ACCURACY) -> str:
    """Table 3: per model and method, the metric over the configurations: mean / std / best of an accuracy, or
    geometric mean / mean / best of a perplexity (`stats.summary`'s columns); the best centre in bold."""
    label, name, digits, summary_digits = _words(objective)
    center, spread, best = (
        objective.center,
        "mean" if multiplicative(objective.metric) else "std",
        "min" if objective.ascending else "max",
    )
    rows: list = []
    for k, (model, table) in enumerate(methods.items()):
        if k:
            rows.append(r"\midrule")
        top = _best(table[center].tolist(), objective)
        for i, (method, r) in enumerate(table.iterrows()):
            rows.append(
                [
                    escape(model) if i == 0 else "",
                    escape(str(method).capitalize()),
                    number(r[center], digits, bold=r[center] == top),
                    number(r[spread], summary_digits),
                    number(r[best], digits),
                ]
            )
    if multiplicative(objective.metric):
        header = [
            rf"\textbf{{Model}} & \textbf{{Method}} & \textbf{{Geo-mean {label}}} & \textbf{{Mean {label}}} & "
            rf"\textbf{{Best {label}}} \\"
        ]
        caption = (f"Pruning methods compared: geometric mean, mean and best (lowest) {name} over each method's "
                   "configurations.")
    else:
        header = [
            rf"\textbf{{Model}} & \textbf{{Method}} & \textbf{{Mean {label}}} & \textbf{{Std}} & "
            rf"\textbf{{Best {label}}} \\"
        ]
        caption = (
            f"Pruning methods compared: mean, standard deviation and best {name} over each method's configurations."
        )
    return _table(caption, "tab:method_comparison", "llccc", header, rows)


def trend(values: list[float]) -> str:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if len(finite) < 2:
        return "--"
    if all(b > a for a, b in zip(finite, finite[1:])):
        return "monotonic increase"
    if all(b < a for a, b in zip(finite, finite[1:])):
        return "monotonic decrease"
    return "peak at {}"


def seq_len_table(impact: dict[str, pd.DataFrame], objective: Objective = ACCURACY) -> str:
    """Table 4: the metric's centre (mean; geometric mean of a perplexity) per taylor_seq_len for each model, the
    best in bold, with its trend."""
    _, name, _, summary_digits = _words(objective)
    seq_lens = sorted({int(s) for table in impact.values() for s in table.index})
    rows = []
    for model, table in impact.items():
        means = [float(table[objective.center].get(s)) if s in table.index else None for s in seq_lens]
        top = _best(means, objective)
        words = trend(means)
        if words == "peak at {}":
            words = f"{'lowest' if objective.ascending else 'peak'} at {seq_lens[means.index(top)]}"
        rows.append(
            [escape(model), *[number(m, summary_digits, bold=m is not None and m == top) for m in means], words]
        )
    n = len(seq_lens)
    header = [rf" & \multicolumn{{{n}}}{{c}}{{\textbf{{taylor\_seq\_len}}}} & \\", rf"\cmidrule(lr){{2-{1 + n}}}",
              r"\textbf{Model} & " + " & ".join(rf"\textbf{{{s}}}" for s in seq_lens) + r" & \textbf{Trend} \\"]
    average = "Geometric mean" if multiplicative(objective.metric) else "Mean"
    caption = f"{average} {name} for each taylor\\_seq\\_len, over all methods and sample counts."
    return _table(caption, "tab:taylor_params", "l" + "c" * n + "l", header, rows)


def document(tables: list[str]) -> str:
    """A standalone document holding every table, so that one pdflatex run checks them all."""
    return (
        "\\documentclass{article}\n\\usepackage{booktabs}\n\\begin{document}\n"
        + "\n".join(tables)
        + "\\end{document}\n"
    )
