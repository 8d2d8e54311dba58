"""The shipped GPU experiments (`experiments/paper_grid_20.yaml`, `experiments/tpe_asha.yaml`) run through Ray with
`gpu: 1` on one machine, on the LLaMA-3-8B shape (issue 67, point 3).

Each experiment file is read as shipped and changed only where a bare GPU machine must: its model is the shape's
folder (random weights, bench_gpu's build), its calibration, perplexity text and task data the offline world's real
ones (no hub), its search space cut to `--trials` configurations, its items per task and perplexity windows limited
so that a lease's minutes hold both sweeps. Resources, search algorithm, scheduler, dtype and device stay as
shipped. Each sweep runs as a user runs it (`taylor-tune sweep`, a process of its own starting Ray), then
`taylor-tune report` reads its Tune results. Recorded per sweep: its exit status and wall time, per trial its status,
seconds, the tasks whose requests it built (the first trial of the model builds all seven, every later one reads the
request cache: 0) and its peak GPU memory; whether the report found the best configuration.

    python bench/bench_gpu_sweep.py --tokenizers /tmp/tok --json $OUT/gpu_sweep.json     # there, after remote.sh
    .venv/bin/python bench/bench_gpu_sweep.py --small --json /tmp/sweep_small.json        # here: the tiny shape, CPU
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from bench_gpu import SHAPES, SMALL, build_folder

from taylor_tune import schema
from taylor_tune.jsonio import write_json
from taylor_tune.reporting.frame import read_experiment

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ("paper_grid_20", "tpe_asha")


def experiment(name: str, folder: Path, args) -> dict:
    """The shipped experiment `name`, changed only where this machine must (see the module's docstring)."""
    config = yaml.safe_load((ROOT / "experiments" / f"{name}.yaml").read_text())
    config["models"] = [str(folder)]
    grid = config["search"]["algorithm"] == "grid"
    if grid:  # the paper grid's dimensions, `--trials` seq_lens of one sample count and method
        config["search_space"] = {"taylor_seq_len": {"grid": [64, 128, 256][: args.trials]},
                                  "taylor_num_samples": {"grid": [32]}, "pruning_method": {"grid": ["taylor"]}}
    else:  # the same dimensions as choices, `--trials` of them drawn
        config["search_space"] = {"taylor_seq_len": {"choice": [64, 128]}, "taylor_num_samples": {"choice": [32]},
                                  "pruning_method": {"choice": ["taylor", "layerwise"]}}
        config["search"]["num_trials"] = args.trials
    config["prune"] |= {"calibration": "wiki"}
    config["evaluation"] |= {"task_data": "real", "ppl": "wiki", "ppl_max_windows": args.ppl_windows,
                             "fidelities": [args.limit // 2, args.limit] if len(config["evaluation"]["fidelities"]) > 1
                             else [args.limit]}
    if args.small:
        config["prune"] |= {"device": "cpu", "dtype": "float32"}
        config["resources"] = {"cpu": 1, "gpu": 0}
    config.pop("storage_path", None)
    return config


def trials(location: Path, limit: int) -> list[dict]:
    """Each trial's status, seconds, requests built by its last pass and peak GPU memory, from its Tune results."""
    frame = read_experiment(str(location))
    stage = schema.zero_shot_stage(limit)
    keep = {"trial_id": "trial", "time_total_s": "seconds", "acc_mean": "acc_mean",
            "ppl": "ppl", schema.requests_key(stage, "_built"): "requests_built",
            schema.requests_key(schema.zero_shot_stage(limit // 2), "_built"): "requests_built_first_rung",
            "peak_gpu_memory_bytes": "peak_bytes", "pruning_method": "method", "taylor_seq_len": "seq_len"}
    rows = frame.to_dict("records")
    return [{new: row.get(old) for old, new in keep.items() if row.get(old) == row.get(old)} for row in rows]


def run(command: list[str], log: Path) -> dict:
    start = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    return {"command": " ".join(command[2:]), "exit": code, "seconds": time.perf_counter() - start,
            "tail": log.read_text().splitlines()[-6:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--small", action="store_true", help="the tiny shape on CPU (gpu: 0): this script's check")
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--trials", type=int, default=2, help="configurations per sweep")
    parser.add_argument("--limit", type=int, default=100, help="items per task of the last fidelity")
    parser.add_argument("--ppl-windows", type=int, default=16)
    parser.add_argument("--experiments", default=",".join(EXPERIMENTS))
    parser.add_argument("--tokenizers", type=Path, help="bench_gpu.py's --tokenizers")
    args = parser.parse_args()
    shape = SMALL["tiny-llama-shape"] if args.small else SHAPES[args.shape]
    device, dtype = (torch.device("cpu"), torch.float32) if args.small else (torch.device("cuda"), torch.bfloat16)
    work = Path(tempfile.mkdtemp(prefix="gpu-sweep-"))
    data = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "date": time.strftime("%Y-%m-%d %H:%M"), "shape": "tiny-llama-shape" if args.small else args.shape,
            "limit": args.limit, "sweeps": {}}
    try:
        folder = work / "model"
        start = time.perf_counter()
        data["params"] = build_folder(shape, folder, device, dtype, args.tokenizers)
        data["build_s"] = time.perf_counter() - start
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the sweep's trials are other processes: they need the memory
        for name in args.experiments.split(","):
            config = experiment(name, folder, args)
            path = work / f"{name}.yaml"
            path.write_text(yaml.safe_dump(config))
            storage = work / "sweeps"
            entry = data["sweeps"][name] = {"experiment": config}
            entry["sweep"] = run([sys.executable, "-m", "taylor_tune", "sweep", str(path), "--storage", str(storage)],
                                 work / f"{name}.log")
            write_json(args.json, data)
            entry["trials"] = trials(storage / name, args.limit)
            report = run([sys.executable, "-m", "taylor_tune", "report", str(storage / name), "--output",
                          str(work / f"report_{name}")], work / f"report_{name}.log")
            best = sorted((work / f"report_{name}").glob("best_*"))
            entry["report"] = report | {"best_folders": [p.name for p in best],
                                        "files": len(list((work / f"report_{name}").rglob("*")))}
            write_json(args.json, data)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({name: {"exit": e["sweep"]["exit"], "seconds": round(e["sweep"]["seconds"], 1),
                             "trials": e.get("trials"), "report_exit": e.get("report", {}).get("exit")}
                      for name, e in data["sweeps"].items()}, indent=1, default=str))


if __name__ == "__main__":
    main()
