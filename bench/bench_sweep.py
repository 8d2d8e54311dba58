"""Sweep benchmarks on the offline world (CPU):

1. importance cache on the paper-grid shape (seq_len 5 x num_samples 3 x method 3 = 45 trials, tiny-llama):
   wall time of every trial's importance stage with the shared cache versus computing it in every trial;
2. fixed per-trial overhead of the Tune path versus calling the trial function directly (same trials,
   one at a time in both cases).

    .venv/bin/python bench/bench_sweep.py --json bench/out/sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from taylor_tune.config import PruneConfig  # noqa: E402
from taylor_tune.pruning.groups import describe_layout  # noqa: E402
from taylor_tune.pruning.importance import compute_importance  # noqa: E402
from taylor_tune.pruning.importance_cache import ImportanceCache  # noqa: E402
from taylor_tune.pruning.scoring import Calibration, score_groups  # noqa: E402
from taylor_tune.sources.calibration import load_calibration  # noqa: E402
from taylor_tune.sources.models import load_model, load_tokenizer  # noqa: E402
from taylor_tune.sweep.experiment import load_experiment  # noqa: E402
from taylor_tune.sweep.trial import run_trial  # noqa: E402

SEQ_LENS, SAMPLES, METHODS = (16, 32, 64, 128, 256), (128, 256, 512), ("taylor", "layerwise", "blockwise")


def cache_benchmark(model_name: str) -> dict:
    model, tokenizer = load_model(model_name), load_tokenizer(model_name)
    layout = describe_layout(model)
    trials = [(s, n, m) for s in SEQ_LENS for n in SAMPLES for m in METHODS]

    start = time.perf_counter()
    for seq_len, n, _ in trials:  # what each trial pays when it computes its own importance
        ids = load_calibration(tokenizer, "world", seq_len=seq_len, num_samples=n, seed=0)
        compute_importance(model, layout, ids, micro_batch_size=8)
    uncached = time.perf_counter() - start

    with tempfile.TemporaryDirectory() as cache_dir:
        start = time.perf_counter()
        for seq_len, n, method in trials:
            config = PruneConfig(model=model_name, method=method, seq_len=seq_len, num_samples=n, calibration="world",
                                 device="cpu", dtype="float32")
            score_groups(model, layout, Calibration(config, tokenizer), cache=ImportanceCache(cache_dir),
                         sample_counts=SAMPLES)
        cached = time.perf_counter() - start
        counters = ImportanceCache(cache_dir).counters()
    return {"trials": len(trials), "uncached_s": uncached, "cached_s": cached, "speedup": uncached / cached, **counters}


def overhead_benchmark(trials: int) -> dict:
    import ray

    from taylor_tune.sweep.tune.driver import _start_ray, run_sweep
    from taylor_tune.sweep.tune.trainable import trial_config

    with tempfile.TemporaryDirectory() as storage:
        experiment = load_experiment(Path(__file__).resolve().parent.parent / "experiments" / "smoke.yaml",
                                     storage_path=storage, name="overhead")
        experiment = experiment.model_copy(update={
            "models": ("tiny-llama",), "search": experiment.search.model_copy(update={"max_concurrent": 1}),
        })
        from taylor_tune.sweep.tune.space import fixed_settings

        points = experiment.grid_points()[:trials]
        configs = [dict(p, fixed=fixed_settings(experiment, None)) for p in points]
        run_trial(trial_config(configs[0]), Path(storage) / "warmup")  # imports and first-use costs, once
        start = time.perf_counter()
        for i, config in enumerate(configs):
            run_trial(trial_config(config), Path(storage) / f"direct-{i}")
        direct = (time.perf_counter() - start) / trials

        start = time.perf_counter()
        _start_ray()
        ray_init = time.perf_counter() - start
        space = experiment.search_space.model_copy(update={
            "taylor_seq_len": experiment.search_space.taylor_seq_len.model_copy(update={"grid": (16,)}),
        })
        experiment = experiment.model_copy(update={"search_space": space})
        n = experiment.grid_size()
        start = time.perf_counter()
        run_sweep(experiment)
        tune_total = time.perf_counter() - start
        ray.shutdown()
    return {"trials_direct": trials, "direct_per_trial_s": direct, "ray_init_s": ray_init, "tune_trials": n,
            "tune_per_trial_s": tune_total / n, "overhead_per_trial_s": tune_total / n - direct}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = {
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    }
    result["cache"] = cache_benchmark(args.model)
    print(json.dumps(result["cache"], indent=2), flush=True)
    result["overhead"] = overhead_benchmark(args.trials)
    print(json.dumps(result["overhead"], indent=2), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
