"""Depth and mixed cuts in a sweep: a combination no pruning can be (depth with a depth share) is refused before
Ray naming it; width and depth trials run side by side through Ray Tune and the report names each point's family."""

import pytest

from taylor_tune.reporting import build_report
from tests.sweep_helpers import analysis_rows, run_sweep_to_end, write_experiment
from tests.test_refused_before_work import experiment, nothing_started, one_line, run


def test_depth_with_a_depth_share_in_the_grid_is_refused_before_ray(capsys, tmp_path):
    path = experiment(tmp_path, search_space={"pruning_method": {"grid": ["taylor", "depth"]},
                                              "depth_share": {"grid": [0.0, 0.5]}})
    code, _, err = run(capsys, "sweep", path)
    one_line(code, err, "search_space: the combination (pruning_method 'depth', depth_share 0.5) is not a valid "
                        "pruning", "depth removes whole layers only")
    nothing_started(tmp_path)


@pytest.mark.slow  # a Ray sweep
def test_width_and_depth_trials_side_by_side_and_their_families_in_the_report(tmp_path, ray_head):
    path = write_experiment(
        tmp_path, "families",
        search_space={"pruning_method": {"grid": ["taylor", "depth"]}, "depth_share": {"grid": [0.0]}},
        prune={"sparsity": 0.3, "seq_len": 32, "num_samples": 8, "calibration": "world", "device": "cpu",
               "dtype": "float32", "depth_criterion": "block_influence"},
        evaluation={"tasks": "piqa", "task_data": "world", "ppl": "world", "ppl_max_windows": 4, "batch_size": 16,
                    "fidelities": [10],
                    "speed": {"prefill_batch": 1, "prefill_len": 16, "decode_batch": 2, "prompt_len": 4,
                              "new_tokens": 2, "repeats": 2, "warmup": 0}},
        objectives=[{"metric": "acc_mean"}, {"metric": "decode_speedup"}],
        search={"algorithm": "grid", "max_concurrent": 2},
    )
    run_sweep_to_end(path, cluster=ray_head)
    rows = {r["pruning_method"]: r for r in analysis_rows(tmp_path / "sweeps" / "families")}
    assert set(rows) == {"taylor", "depth"} and all(r["stage"] == "zero_shot_10" for r in rows.values())
    assert rows["depth"]["depth_criterion"] == "block_influence" and rows["depth"]["decode_speedup_se"] >= 0
    front = build_report(tmp_path / "sweeps" / "families").models["tiny-llama"].front
    assert dict(zip(front["pruning_method"], front["family"])) == {"taylor": "width", "depth": "depth"}
