"""A 12-trial grid on a 3-node Ray cluster with S3 storage, against the same grid on one node with local storage
(issue 81, must-show 5). The cluster is a `ray.cluster_utils.Cluster` on this machine: a head that runs no trial
(the driver and the lease actor) and two worker nodes of one CPU each, sharing no folder; the storage a real S3
server on loopback (SeaweedFS, `tests/s3_helpers.py`). The one node is a local Ray of two CPUs. Both run two trials
at a time, so the comparison is the price of the bucket and the coordination, not of parallelism.

Reported per run: the sweep's wall time (the `taylor-tune sweep` command), importance passes computed and request
builds (the caches' own events), the caches' bytes read and written (each trial's `store_bytes_*`), what the
experiment holds in storage at the end (every object Tune and the trials wrote), and the coordination: lease round
trips and seconds spent in them (`store_lease_calls`, `store_lease_wait_s`, summed over trials), storage retries.
Each setup runs `--repeats` times, alternating, each run a fresh experiment; one JSON line per run is appended to
`--out` (resumable: runs already there are skipped).

    python bench/bench_cluster.py --out bench/out/cluster.jsonl --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.s3_helpers import BUCKET, seaweedfs  # noqa: E402  (the tests' S3 server on loopback)

GRID = {
    "models": ["tiny-llama"],
    "search_space": {"taylor_seq_len": {"grid": [16, 32, 48, 64]}, "taylor_num_samples": {"grid": [16]},
                     "pruning_method": {"grid": ["taylor", "layerwise", "blockwise"]}},
    "prune": {"sparsity": 0.2, "calibration": "world", "device": "cpu", "dtype": "float32"},
    "evaluation": {"tasks": "piqa,arc_easy", "task_data": "world", "ppl": "world", "ppl_max_windows": 8,
                   "batch_size": 16, "fidelities": [50], "speed": None},
    "resources": {"cpu": 1, "gpu": 0},
    "search": {"algorithm": "grid", "max_concurrent": 2},
    "max_failures": 1,
}


def environment(**extra: str) -> dict:
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TQDM_DISABLE": "1", **extra}


def objects(location: str) -> tuple[int, int, list[str]]:
    """(count, bytes, relative names) of every file under `location` (a folder or a URI)."""
    from pyarrow import fs

    from taylor_tune.storage.location import open_location

    filesystem, root = open_location(location)
    infos = filesystem.get_file_info(fs.FileSelector(root, recursive=True, allow_not_found=True))
    files = [i for i in infos if i.type == fs.FileType.File]
    return len(files), sum(i.size for i in files), [i.path.removeprefix(root + "/") for i in files]


def measured(folder: str, seconds: float) -> dict:
    from taylor_tune.storage.cache import Store
    from taylor_tune.storage.location import open_location

    filesystem, root = open_location(folder)
    count, size, names = objects(folder)
    trials = []
    for name in names:
        if name.endswith("/result.json"):
            with filesystem.open_input_stream(f"{root}/{name}") as stream:
                lines = stream.read().decode().splitlines()
            trials.append(json.loads(lines[-1]))
    finished = [t for t in trials if t.get("stage", "").startswith("zero_shot_")]
    passes = Store(f"{folder}/importance_cache").events()
    requests = Store(f"{folder}/requests").events()

    def total(key: str) -> float:
        return sum(t.get(key, 0) for t in finished)

    return {"wall_s": seconds, "trials": len(finished),
            "passes_computed": sum(e["event"] == "computed" for e in passes),
            "passes_read": sum(e["event"] == "hit" for e in passes),
            "takeovers": sum(e["event"] == "takeover" for e in passes + requests),
            "request_builds": sum(e["event"] == "computed" for e in requests),
            "cache_bytes_read": total("store_bytes_read"), "cache_bytes_written": total("store_bytes_written"),
            "node_copy_hits": total("store_copy_hits"), "storage_retries": total("store_storage_retries"),
            "lease_calls": total("store_lease_calls"), "lease_wait_s": total("store_lease_wait_s"),
            "experiment_objects": count, "experiment_bytes": size,
            "nodes": sorted({e.get("node") for e in passes + requests if e.get("node")})}


def run_local(work: Path, name: str) -> dict:
    storage = work / "sweeps"
    experiment = work / f"{name}.yaml"
    experiment.write_text(yaml.safe_dump({"name": name, **GRID, "storage_path": str(storage)}))
    temp = Path("/tmp") / f"tbl-{os.getpid()}"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "taylor_tune", "sweep", str(experiment)], cwd=ROOT,
                          env=environment(RAY_TMPDIR=str(temp)), capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"local sweep failed: {proc.stderr[-2000:]}")
    return measured(str(storage / name), seconds)


def run_cluster(work: Path, name: str, server: dict) -> dict:
    from ray.cluster_utils import Cluster

    for key, value in server["env"].items():  # the nodes, the driver and this process: the server on loopback
        os.environ[key] = value
    os.environ.update({"RAY_USAGE_STATS_ENABLED": "0", "TQDM_DISABLE": "1"})
    temp = Path("/tmp") / f"tbc-{os.getpid()}"
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False, "temp_dir": str(temp),
        "_system_config": {"worker_niceness": 0}})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        storage = f"s3://{BUCKET}/bench"
        experiment = work / f"{name}.yaml"
        experiment.write_text(yaml.safe_dump({"name": name, **GRID, "storage_path": storage}))
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "taylor_tune", "sweep", str(experiment)], cwd=ROOT,
                              env=environment(RAY_ADDRESS=cluster.address, TAYLOR_TUNE_METRICS_FLUSH_S="0"),
                              capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"cluster sweep failed: {proc.stderr[-2000:]}")
        return measured(f"{storage}/{name}", seconds)
    finally:
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "cluster.jsonl")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["setup"], r["repeat"]) for r in map(json.loads, args.out.read_text().splitlines())} \
        if args.out.is_file() else set()
    with tempfile.TemporaryDirectory() as scratch, seaweedfs(Path(scratch) / "seaweedfs") as server:
        for repeat in range(args.repeats):
            for setup in ("one node, local", "3-node cluster, s3"):
                if (setup, repeat) in done:
                    continue
                work = Path(scratch) / f"{setup[:3]}-{repeat}"
                work.mkdir()
                name = f"grid{repeat}"
                row = run_local(work, name) if setup.startswith("one") else run_cluster(work, name, server)
                row |= {"setup": setup, "repeat": repeat, "date": datetime.now(UTC).isoformat(timespec="seconds"),
                        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"}
                with open(args.out, "a") as out:
                    out.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
