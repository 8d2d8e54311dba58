"""The speed axis measured, not noise (issue 40): no two trials on a node time at the same moment (their recorded
windows never overlap), and a model whose layer shapes an earlier trial of the sweep timed reads that measurement."""

import threading
import time

import pytest

from taylor_tune.config import PruneConfig, SpeedSpec
from taylor_tune.sweep.lock import timing_lock
from taylor_tune.sweep.trial import run_trial
from tests.sweep.test_trial import trial

SPEED = SpeedSpec(prefill_batch=1, prefill_len=32, decode_batch=2, prompt_len=8, new_tokens=4, repeats=3, warmup=1)


def overlapping(windows: list[tuple[float, float]]) -> bool:
    windows = sorted(windows)
    return any(later[0] < earlier[1] for earlier, later in zip(windows, windows[1:]))


def test_the_timing_lock_lets_one_holder_time_at_a_time(tmp_path):
    windows, lock = [], tmp_path / "speed.lock"

    def hold():
        with timing_lock(lock):
            start = time.time()
            time.sleep(0.15)
            windows.append((start, time.time()))

    threads = [threading.Thread(target=hold) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(windows) == 4 and not overlapping(windows)
    assert overlapping([(0.0, 1.0), (0.5, 2.0)]) and not overlapping([(0.0, 1.0), (1.0, 2.0)])  # the check itself


def with_speed(config, prune: PruneConfig | None = None):
    return config.model_copy(update={"evaluation": config.evaluation.model_copy(update={"speed": SPEED}),
                                     **({"prune": prune} if prune else {})})


@pytest.mark.slow  # three trials
def test_concurrent_trials_never_time_at_the_same_moment(tmp_path):
    results = {}

    def run(name: str, sparsity: float):
        base = trial(8)
        results[name] = run_trial(with_speed(base, base.prune.model_copy(update={"sparsity": sparsity})),
                                  tmp_path / name)

    threads = [threading.Thread(target=run, args=(f"t{i}", s)) for i, s in enumerate((0.2, 0.3, 0.4))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    windows = [(r["speed_timed_from"], r["speed_timed_to"]) for r in results.values()]
    assert len(windows) == 3 and not overlapping(windows)
    assert all(r["speed_reused"] is False and r["speed_wait_s"] >= 0 for r in results.values())


@pytest.mark.slow  # three trials
def test_a_model_of_the_same_shapes_reads_the_earlier_measurement(tmp_path):
    cache = str(tmp_path / "sweep" / "importance_cache")
    first = run_trial(with_speed(trial(8, cache)), tmp_path / "a")
    # the same pruning evaluated at another fidelity: the same layer shapes, so the same model to time
    same = trial(8, cache)
    same = same.model_copy(update={"evaluation": same.evaluation.model_copy(update={"fidelities": (6,)})})
    second = run_trial(with_speed(same), tmp_path / "b")
    other = run_trial(with_speed(trial(8, cache), trial(8).prune.model_copy(update={"sparsity": 0.4})),
                      tmp_path / "c")
    assert first["speed_reused"] is False and second["speed_reused"] is True and other["speed_reused"] is False
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "decode_tokens_per_s_se", "decode_speedup",
                "decode_speedup_low", "unpruned_decode_tokens_per_s"):
        assert second[key] == first[key]
    assert "speed_timed_from" not in second and other["decode_tokens_per_s"] != first["decode_tokens_per_s"]
    assert len(list((tmp_path / "sweep" / "paired_speed").glob("*.json"))) == 2
