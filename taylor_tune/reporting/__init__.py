"""Reporting: Tune results -> tidy trial table (frame) -> statistics (stats, pareto) -> a Report (build) -> text
and Markdown (render) -> report files (write); a running sweep's progress (status). Imports neither torch nor ray,
and nothing imports it but the export (which chooses a trial by it) and the CLI.

The same functions serve a notebook and `taylor-tune report`:

    from taylor_tune.reporting import build_report, write_report
    report = build_report("runs/sweeps/smoke")        # or an ExperimentAnalysis, ResultGrid or DataFrame
    print(render_text(report)); write_report(report, "runs/reports/smoke")

Several objectives: `report.models[m].front` is the Pareto front (pareto.pareto_front); the best configuration under
constraints is `build_report(path, constraints=["decode_speedup>=1.3"])`, or on any table of one model's trials
`best_under(table.valid, [parse_constraint("decode_speedup>=1.3")], table.objective)`.
"""

from taylor_tune.reporting.build import Report, build_report
from taylor_tune.reporting.frame import TrialTable, consolidate, load_trials, read_experiment
from taylor_tune.reporting.pareto import Constraint, best_under, pareto_front, parse_constraint
from taylor_tune.reporting.render import render_markdown, render_text
from taylor_tune.reporting.write import write_report

__all__ = ["Constraint", "Report", "TrialTable", "best_under", "build_report", "consolidate", "load_trials",
           "pareto_front", "parse_constraint", "read_experiment", "render_markdown", "render_text", "write_report"]
