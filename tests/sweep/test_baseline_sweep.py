"""The activation baselines in a sweep: flap with a layer-allocating method is refused before Ray naming the
combination; taylor, wanda_sp and flap run side by side through Ray Tune on one calibration draw, the activation
statistics computed once and read by the other baseline, and the report's method comparison holds all three."""


import pytest

from taylor_tune.reporting import build_report
from taylor_tune.storage.cache import Store
from tests.sweep_helpers import analysis_rows, run_sweep_to_end, write_experiment
from tests.test_refused_before_work import experiment, nothing_started, one_line, run


def test_flap_with_layerwise_in_the_grid_is_refused_before_ray(capsys, tmp_path):
    path = experiment(tmp_path, search_space={"pruning_method": {"grid": ["taylor", "layerwise"]},
                                              "criterion": {"grid": ["taylor", "flap"]}})
    code, _, err = run(capsys, "sweep", path)
    one_line(code, err, "search_space: the combination (pruning_method 'layerwise', criterion 'flap') is not a valid "
                        "pruning", "flap's standardized scores carry no layer's size")
    nothing_started(tmp_path)


@pytest.mark.slow  # a Ray sweep
def test_taylor_wanda_sp_and_flap_side_by_side_through_ray(tmp_path, ray_head):
    path = write_experiment(
        tmp_path, "baselines",
        search_space={"criterion": {"grid": ["taylor", "wanda_sp", "flap"]}},
        prune={"method": "taylor", "sparsity": 0.3, "seq_len": 32, "num_samples": 8, "calibration": "world",
               "device": "cpu", "dtype": "float32"},
        evaluation={"tasks": "piqa", "task_data": "world", "ppl": "world", "ppl_max_windows": 4, "batch_size": 16,
                    "fidelities": [10]},
        search={"algorithm": "grid", "max_concurrent": 1},
    )
    run_sweep_to_end(path, cluster=ray_head)
    rows = {r["criterion"]: r for r in analysis_rows(tmp_path / "sweeps" / "baselines")}
    assert set(rows) == {"taylor", "wanda_sp", "flap"} and all(r["stage"] == "zero_shot_10" for r in rows.values())
    assert all(r["ppl"] > 1 and 0 <= r["acc_mean"] <= 1 for r in rows.values())
    events = [e["event"] for e in Store(tmp_path / "sweeps" / "baselines" / "importance_cache").events()]
    assert sorted(events) == ["computed", "computed", "hit"]  # the gradient pass, the statistics, read once more
    report = build_report(tmp_path / "sweeps" / "baselines").models["tiny-llama"]
    assert set(report.methods["table"].index) == {"taylor", "taylor+wanda_sp", "taylor+flap"}
