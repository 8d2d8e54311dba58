"""Reporting: Tune results -> tidy trial table (frame) -> statistics (stats, pareto) -> a Report (build) -> text
and Markdown (render) -> report files (write). Imports neither torch nor ray.

The same functions serve a notebook and `taylor-tune report`:

    from taylor_tune.reporting import build_report, write_report
    report = build_report("runs/sweeps/smoke")        # or an ExperimentAnalysis, ResultGrid or DataFrame
    print(render_text(report)); write_report(report, "runs/reports/smoke")

Several objectives: `report.models[m].front` is the Pareto front (pareto.pareto_front); the best configuration under
constraints is `build_report(path, constraints=["decode_speedup>=1.3"])`, or on any table of one model's trials
`best_under(table.valid, [parse_constraint("decode_speedup>=1.3")], table.objective)`.
"""

import importlib

# Each name is imported from its module when first asked for (PEP 562): a module that needs one part of reporting
# (every trial's worker reads `reporting.paired` through racing) does not import the rest (scipy's stats, the
# report's build), ~0.9 s of every Ray worker's start.
_WHERE = {"Report": "build", "build_report": "build", "TrialTable": "frame", "consolidate": "frame",
          "load_trials": "frame", "read_experiment": "frame", "Constraint": "pareto", "best_under": "pareto",
          "pareto_front": "pareto", "parse_constraint": "pareto", "render_markdown": "render",
          "render_text": "render", "write_report": "write"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
