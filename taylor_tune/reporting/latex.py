"""The paper's LaTeX tables (reference/001 Tables 1-4) as booktabs strings, from report data; pure.

Only `booktabs` is needed (no multirow): a model's name stands on the first row of its block.
"""

from __future__ import annotations

import math

import pandas as pd

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


def best_configs_table(cross: pd.DataFrame, sparsity: str = "") -> str:
    """Table 1: each model's best configuration."""
    top = cross["best_acc"].max() if len(cross) else None
    rows = [[escape(r.model), escape(str(r.best_method).capitalize()), escape(r.taylor_seq_len), escape(r.taylor_num_samples),
             number(r.best_acc, bold=r.best_acc == top), number(r.best_ppl, 2)] for r in cross.itertuples()]
    header = [r"\textbf{Model} & \textbf{Method} & \textbf{seq\_len} & \textbf{samples} & \textbf{Avg ACC} & \textbf{PPL} \\"]
    caption = f"Best pruning configuration found for each model{sparsity}, chosen by the highest mean zero-shot accuracy."
    return _table(caption, "tab:optimal_configs", "lccccc", header, rows)


def task_table(best_rows: list[dict], tasks: tuple[str, ...]) -> str:
    """Table 2: per-task accuracy of each model's best configuration; the best of each column in bold."""
    columns = ["acc_mean", *[f"acc_{t}" for t in tasks]]
    tops = {c: max((r[c] for r in best_rows if r.get(c) is not None), default=None) for c in columns}
    rows = [[escape(r["model"]), escape(str(r["pruning_method"]).capitalize()),
             *[number(r.get(c), 3, bold=r.get(c) is not None and r.get(c) == tops[c]) for c in columns]] for r in best_rows]
    span = len(columns)
    header = [rf" & & \multicolumn{{{span}}}{{c}}{{\textbf{{Zero-shot accuracy}}}} \\",
              rf"\cmidrule(lr){{3-{2 + span}}}",
              r"\textbf{Model} & \textbf{Method} & \textbf{Avg} & "
              + " & ".join(rf"\textbf{{{escape(TASK_HEADERS.get(t, t))}}}" for t in tasks) + r" \\"]
    caption = "Zero-shot accuracy of each model's best configuration, task by task."
    return _table(caption, "tab:detailed_performance", "ll" + "c" * span, header, rows)


def method_table(methods: dict[str, pd.DataFrame]) -> str:
    """Table 3: per model and method, mean / std / best acc_mean over the configurations; best mean in bold."""
    rows: list = []
    for k, (model, table) in enumerate(methods.items()):
        if k:
            rows.append(r"\midrule")
        best_mean = table["mean"].max() if len(table) else None
        for i, (method, r) in enumerate(table.iterrows()):
            rows.append([escape(model) if i == 0 else "", escape(str(method).capitalize()),
                         number(r["mean"], bold=r["mean"] == best_mean), number(r["std"], 3), number(r["max"])])
    header = [r"\textbf{Model} & \textbf{Method} & \textbf{Mean ACC} & \textbf{Std} & \textbf{Best ACC} \\"]
    caption = "Pruning methods compared: mean, standard deviation and best acc\\_mean over each method's configurations."
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


def seq_len_table(impact: dict[str, pd.DataFrame]) -> str:
    """Table 4: mean acc_mean per taylor_seq_len for each model, with its trend."""
    seq_lens = sorted({int(s) for table in impact.values() for s in table.index})
    rows = []
    for model, table in impact.items():
        means = [float(table["mean"].get(s)) if s in table.index else None for s in seq_lens]
        finite = [m for m in means if m is not None]
        top = max(finite) if finite else None
        words = trend(means)
        if words == "peak at {}":
            words = f"peak at {seq_lens[means.index(top)]}"
        rows.append([escape(model), *[number(m, 3, bold=m is not None and m == top) for m in means], words])
    n = len(seq_lens)
    header = [rf" & \multicolumn{{{n}}}{{c}}{{\textbf{{taylor\_seq\_len}}}} & \\", rf"\cmidrule(lr){{2-{1 + n}}}",
              r"\textbf{Model} & " + " & ".join(rf"\textbf{{{s}}}" for s in seq_lens) + r" & \textbf{Trend} \\"]
    caption = "Mean accuracy for each taylor\\_seq\\_len, over all methods and sample counts."
    return _table(caption, "tab:taylor_params", "l" + "c" * n + "l", header, rows)


def document(tables: list[str]) -> str:
    """A standalone document holding every table, so that one pdflatex run checks them all."""
    return "\\documentclass{article}\n\\usepackage{booktabs}\n\\begin{document}\n" + "\n".join(tables) + "\\end{document}\n"
