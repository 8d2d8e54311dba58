"""A Report's folder: the text and Markdown reports, each model's best configuration, method comparison and best
trial's artifacts, the LaTeX tables, the figures and the consolidated table. The only reporting module that writes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pandas as pd

from taylor_tune.errors import ReportError
from taylor_tune.jsonio import write_json
from taylor_tune.reporting import latex, plots, stats
from taylor_tune.reporting.build import ModelReport, Report
from taylor_tune.reporting.frame import ARTIFACTS
from taylor_tune.reporting.render import render_markdown, render_text
from taylor_tune.schema import CONFIG_COLUMNS
from taylor_tune.storage.folder import leaves, read_text
from taylor_tune.storage.location import open_location


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
    best_per_method = {  # by the comparison's own names (taylor+flap, experts+reap)
        method: stats.best_trial(group, m.objective)
        for method, group in m.valid.groupby(stats.method_labels(m.valid))
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


def _refuse_links(out: Path) -> None:
    """Writing into a folder that holds symbolic links would write through them, to wherever they point."""
    for path in (out, *out.rglob("*")) if out.is_dir() else (out,):
        if path.is_symlink():
            raise ReportError(f"--output: {path} is a symbolic link, and the report would write through it; "
                              "write the report to a fresh folder")


def _copy_artifacts(report_dir: Path, m: ModelReport, written: list[Path], filesystem=None) -> None:
    """The best trial's artifacts (the source tools' best_<model>/ layout) and its three per-layer plots."""
    folder = report_dir / f"best_{folder_name(m.model)}"
    written.append(_write_json(folder / "best_config.json", best_config_dict(m)))
    trial_dir = m.best.get("output_dir")
    texts, leaving = {}, []
    if isinstance(trial_dir, str):
        filesystem, root = open_location(trial_dir, filesystem)
        texts = {name: read_text(filesystem, f"{root.rstrip('/')}/{name}") for name in ARTIFACTS}
        leaving = [name for name in ARTIFACTS if leaves(filesystem, root, name)]
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
        if m.recovery is not None:
            m.recovery["table"].to_csv(folder / "recovery_comparison.csv", index=False)
            written.append(folder / "recovery_comparison.csv")
            written.append(_write_json(folder / "recovery_rankings.json", m.recovery["rankings"]))
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
