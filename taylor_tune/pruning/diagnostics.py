"""Diagnostics of one pruning: counts, ratios per layer, extreme layers, spread of gradient statistics.

Pure (numbers in, a dict out). A ratio with a zero denominator is infinite (math.inf) and a statistic without
data is undefined (None); both carry the reason under `notes`, never a silent NaN. Files get them as "inf" / null
through `jsonio.write_json`.
"""

from __future__ import annotations

import math

import numpy as np

from taylor_tune.pruning.plan import ModelLayout, PrunePlan


def spread(values: np.ndarray | None, name: str, notes: dict[str, str]) -> dict[str, float | None]:
    """max/min ratio and max-min range of a per-layer statistic, with notes when not finite."""
    ratio_key, range_key = f"{name}_ratio", f"{name}_range"
    if values is None or len(values) == 0:
        notes[ratio_key] = notes[range_key] = "undefined: no gradient statistics (the method uses no gradients)"
        return {ratio_key: None, range_key: None}
    low, high = float(np.min(values)), float(np.max(values))
    if low == 0.0:
        ratio = math.inf if high > 0 else None
        notes[ratio_key] = (
            "inf: a layer's statistic is 0" if high > 0 else "undefined: every layer's statistic is 0"
        )
    else:
        ratio = high / low
    return {ratio_key: ratio, range_key: high - low}


def pruning_diagnostics(
    layout: ModelLayout,
    plan: PrunePlan,
    *,
    sparsity: float,
    extreme_threshold: float,
    grad_mean: np.ndarray | None,
    grad_norm: np.ndarray | None,
) -> dict:
    removed = plan.layer_params_removed(layout)
    layer_ratio = [r / p for r, p in zip(removed, layout.layer_params)]
    params_after = layout.total_params - sum(removed)
    notes: dict[str, str] = {}
    result = {
        "params_count_before": layout.total_params,
        "params_count": params_after,
        "target_sparsity": sparsity,
        "pruning_ratio": sum(removed) / layout.total_params,
        "layer_pruning_ratio": layer_ratio,
        "layer_retention_ratio": [1.0 - r for r in layer_ratio],
        "extreme_ratio_threshold": extreme_threshold,
        "extreme_pruning_layers": sum(r > extreme_threshold for r in layer_ratio),
        "attention_groups_kept": [0 if i in plan.layers_removed else g - len(a)
                                  for i, (g, a) in enumerate(zip(layout.attn_groups, plan.attn_removed))],
        "mlp_channels_kept": [0 if i in plan.layers_removed else c - len(m)
                              for i, (c, m) in enumerate(zip(layout.mlp_channels, plan.mlp_removed))],
        "layers_removed": list(plan.layers_removed),
        "num_layers_kept": layout.num_layers - len(plan.layers_removed),
        "layer_grad_mean": None if grad_mean is None else [float(x) for x in grad_mean],
        "layer_grad_norm": None if grad_norm is None else [float(x) for x in grad_norm],
    }
    if layout.experts:  # a mixture: its experts per layer (0 for a dense one) and what a token computes with
        result |= {"experts_before": list(layout.experts),
                   "experts_kept": [len(kept) for kept in plan.experts_kept(layout)],
                   "active_params_count_before": layout.active_params,
                   "active_params_count": plan.active_params_after(layout)}
    result |= spread(grad_mean, "grad_mean", notes) | spread(grad_norm, "grad_norm", notes)
    result["notes"] = notes
    return result


def layer_analysis(diagnostics: dict) -> list[dict]:
    """layer_analysis.json: one row per layer of the model before pruning (what the report's per-layer plots
    read)."""
    grad_mean, grad_norm = diagnostics["layer_grad_mean"], diagnostics["layer_grad_norm"]
    return [
        {
            "layer": i,
            "pruning_ratio": r,
            "retention_ratio": 1 - r,
            "attention_groups_kept": diagnostics["attention_groups_kept"][i],
            "mlp_channels_kept": diagnostics["mlp_channels_kept"][i],
            "grad_mean": None if grad_mean is None else grad_mean[i],
            "grad_norm": None if grad_norm is None else grad_norm[i],
        }
        for i, r in enumerate(diagnostics["layer_pruning_ratio"])
    ]
