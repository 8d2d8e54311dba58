"""Diagnostics: per-layer ratios by hand, and infinities or undefined values written out, never NaN."""

import json
import math

import numpy as np
import pytest

from taylor_tune.jsonio import json_safe, write_json
from taylor_tune.pruning.diagnostics import pruning_diagnostics, spread
from taylor_tune.pruning.plan import ModelLayout, PrunePlan

LAYOUT = ModelLayout((4, 4, 4), (10, 10, 10), 20, 3, (110, 110, 110), 500)
PLAN = PrunePlan("t", ((), (0,), (1, 2)), ((1,), (), (0, 1, 2, 3)))


def diag(grad_mean, grad_norm, threshold=0.3):
    return pruning_diagnostics(
        LAYOUT, PLAN, sparsity=0.2, extreme_threshold=threshold, grad_mean=grad_mean, grad_norm=grad_norm
    )


def test_ratios_counts_and_extreme_layers():
    d = diag(np.array([1.0, 2.0, 4.0]), np.array([3.0, 1.0, 2.0]))
    removed = [3, 20, 2 * 20 + 4 * 3]
    assert d["layer_pruning_ratio"] == pytest.approx([r / 110 for r in removed])
    assert d["layer_retention_ratio"] == pytest.approx([1 - r / 110 for r in removed])
    assert d["params_count"] == 500 - sum(removed) and d["pruning_ratio"] == pytest.approx(sum(removed) / 500)
    assert d["extreme_pruning_layers"] == 1  # only 52/110 > 0.3
    assert (d["grad_mean_ratio"], d["grad_mean_range"], d["grad_norm_ratio"], d["grad_norm_range"]) == (
        4.0,
        3.0,
        3.0,
        2.0,
    )
    assert d["notes"] == {}


def test_zero_statistics_are_infinite_or_undefined_and_say_why(tmp_path):
    d = diag(np.array([0.0, 2.0, 4.0]), np.zeros(3))
    assert d["grad_mean_ratio"] == math.inf and "is 0" in d["notes"]["grad_mean_ratio"]  # a float in memory
    assert d["grad_norm_ratio"] is None and "undefined" in d["notes"]["grad_norm_ratio"]
    written = json.loads(write_json(tmp_path / "d.json", d).read_text())  # strict JSON: no Infinity, no NaN
    assert written["grad_mean_ratio"] == "inf" and written["grad_norm_ratio"] is None


def test_json_safe_makes_every_non_finite_float_explicit():
    data = {
        "a": [math.inf, -math.inf, math.nan, 1.5],
        "b": np.float32(2.0),
        "c": np.array([np.inf, 3.0]),
        4: (np.int64(7),),
    }
    assert json_safe(data) == {"a": ["inf", "-inf", None, 1.5], "b": 2.0, "c": ["inf", 3.0], "4": [7]}
    json.dumps(json_safe(data), allow_nan=False)


def test_methods_without_gradients_have_undefined_gradient_spreads():
    d = diag(None, None)
    assert d["grad_mean_ratio"] is None and d["grad_norm_range"] is None
    assert "no gradient" in d["notes"]["grad_norm_range"]
    json.dumps(d, allow_nan=False)


def test_a_layer_pruned_exactly_at_the_threshold_is_not_extreme():
    ratios = diag(None, None)["layer_pruning_ratio"]  # 3/110, 20/110, 52/110
    assert diag(None, None, threshold=ratios[2])["extreme_pruning_layers"] == 0  # "above the threshold": > not >=
    assert diag(None, None, threshold=ratios[1])["extreme_pruning_layers"] == 1
    assert diag(None, None, threshold=ratios[2] * (1 - 1e-12))["extreme_pruning_layers"] == 1


NO_GRADIENTS = "undefined: no gradient statistics (the method uses no gradients)"


@pytest.mark.parametrize("values, expected, notes", [
    ([2.0], (1.0, 0.0), {}),  # one layer: a ratio of 1 and no range, not "no data"
    ([0.0, 0.5], (math.inf, 0.5), {"g_ratio": "inf: a layer's statistic is 0"}),  # below 1: still infinite
    ([0.0, 0.0], (None, 0.0), {"g_ratio": "undefined: every layer's statistic is 0"}),
    ([], (None, None), {"g_ratio": NO_GRADIENTS, "g_range": NO_GRADIENTS}),
    (None, (None, None), {"g_ratio": NO_GRADIENTS, "g_range": NO_GRADIENTS}),
], ids=["one-layer", "zero-and-a-half", "all-zero", "empty", "none"])
def test_spread_written_out_with_the_notes_a_report_shows(values, expected, notes):
    """Each case's ratio, range and note, as the report prints them (the notes are the user's only explanation)."""
    got_notes = {}
    got = spread(None if values is None else np.array(values), "g", got_notes)
    assert got == {"g_ratio": expected[0], "g_range": expected[1]}
    assert got_notes == notes
