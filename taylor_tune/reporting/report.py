"""The analysis report's three steps under one name (what `taylor_tune.reporting.report` offered before they were
split): `build` computes a Report (pure), `render` prints it, `write` writes its folder."""

from taylor_tune.reporting.build import ModelReport, Report, build_report, front_objectives, model_report
from taylor_tune.reporting.render import render_markdown, render_text, sections
from taylor_tune.reporting.write import best_config_dict, folder_name, method_comparison_dict, write_report

__all__ = ["ModelReport", "Report", "best_config_dict", "build_report", "folder_name", "front_objectives",
           "method_comparison_dict", "model_report", "render_markdown", "render_text", "sections", "write_report"]
