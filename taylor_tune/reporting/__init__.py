"""Reporting: Tune results -> tidy trial table -> statistics -> report files. Imports neither torch nor ray.

The same functions serve a notebook and `taylor-tune report`:

    from taylor_tune.reporting import build_report, write_report
    report = build_report("runs/sweeps/smoke")        # or an ExperimentAnalysis, ResultGrid or DataFrame
    print(render_text(report)); write_report(report, "runs/reports/smoke")
"""

from taylor_tune.reporting.frame import TrialTable, consolidate, load_trials, read_experiment
from taylor_tune.reporting.report import Report, build_report, render_markdown, render_text, write_report

__all__ = ["Report", "TrialTable", "build_report", "consolidate", "load_trials", "read_experiment", "render_markdown",
           "render_text", "write_report"]
