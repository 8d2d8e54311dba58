"""Issue 81, must-shows 2 and 3: one sweep across nodes that share no folder but the bucket. A multi-node
`ray.cluster_utils.Cluster` on 127.0.0.1 (a head with no CPU for trials, and worker nodes of one CPU each) and a real
S3 server on loopback (SeaweedFS, `tests/s3_helpers.py`):
- a shared entry is built once across nodes: a trial on another node waits on the sweep's lease actor and reads it
  (and, the control, without the lease both nodes build it: the check can fail);
- a node removed while it holds a lease: the lease is taken over by a trial on another node, one whole entry stored;
- a sweep on the cluster computes each importance pass and builds each task's requests once across the nodes, and a
  sweep whose node is removed mid-pass finishes every trial, its lease taken over, no entry damaged or duplicated;
- a raced sweep on s3 whose driver is SIGKILLed resumes from the bucket alone (a fresh Ray temp folder, another
  working directory): no finished trial runs again and the race's decisions stand.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.s3_helpers import BUCKET, seaweedfs
from tests.sweep_helpers import REPO, SMALL, env, free_port, kill_ray_started_after, wait_for

pytestmark = pytest.mark.slow  # a real S3 server and several Ray nodes

TEMP = Path("/tmp") / f"ttc-{os.getpid()}"  # the cluster's Ray temp root: short (socket paths), its own


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server, pytest.MonkeyPatch.context() as patch:
        for key, value in server["env"].items():  # the test, the nodes it starts and the drivers: this server
            patch.setenv(key, value)
        yield server


class Nodes:
    """A `Cluster` whose processes inherit this environment: `workers` of one CPU each, trials never on the head."""

    def __init__(self, workers: int, **environment: str):
        from ray.cluster_utils import Cluster

        self.patch = pytest.MonkeyPatch()
        for key, value in {"RAY_USAGE_STATS_ENABLED": "0", "TQDM_DISABLE": "1", **environment}.items():
            self.patch.setenv(key, value)
        # nodes on 127.0.0.1 as `ray start --node-ip-address=127.0.0.1` makes them (the suite's shared head too)
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False, "temp_dir": str(TEMP),
            "dashboard_agent_listen_port": free_port(), "ray_client_server_port": free_port(),
            "_system_config": {"worker_niceness": 0}})
        self.workers = [self.add() for _ in range(workers)]

    def add(self):
        return self.cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")

    def connect(self) -> None:
        """This test process joins the cluster as a driver (at loopback, where its head listens)."""
        import ray

        from taylor_tune.compat.ray import on_loopback

        with on_loopback():
            ray.init(address=self.cluster.address)

    def close(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        self.patch.undo()
        kill_ray_started_after(0, TEMP)
        shutil.rmtree(TEMP, ignore_errors=True)


@pytest.fixture
def nodes(s3):
    made = []

    def make(workers: int = 2, **environment: str) -> Nodes:
        made.append(Nodes(workers, **environment))
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()


def bucket(path: str):
    from pyarrow import fs

    return fs.FileSystem.from_uri(path)


def listing(path: str) -> list[str]:
    from pyarrow import fs

    filesystem, root = bucket(path)
    infos = filesystem.get_file_info(fs.FileSelector(root, recursive=True, allow_not_found=True))
    return sorted(i.path.removeprefix(root + "/") for i in infos if i.type == fs.FileType.File)


def events(folder: str) -> list[dict]:
    from taylor_tune.storage.cache import Store

    return Store(folder).events()


def build_task():
    """A Ray task that builds one entry of a store on the node it is placed on, through the sweep's leases (or none)."""
    import ray

    @ray.remote(num_cpus=1, max_retries=0)
    def build(location: str, name: str, seconds: float, leased: bool, cache_dir: str, copies: str) -> dict:
        import time as clock

        import ray as ray_

        from taylor_tune.storage.cache import Store
        from taylor_tune.sweep.tune.leases import RayLeases

        node = ray_.get_runtime_context().get_node_id()
        store = Store(location, leases=RayLeases.of_sweep(cache_dir) if leased else None,
                      copies=Path(copies) / node)

        def make() -> bytes:
            (Path(copies) / f"started-{name}").touch()  # the test's cue: this one is building
            clock.sleep(seconds)
            return f"built on {node}".encode()

        value, event = store.built_once(name, make, bytes)
        return {"node": node, "event": event, "value": value.decode(), "lease_calls": store.stats.lease_calls}

    return build


def on(node):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node.node_id, soft=False)


def test_an_entry_is_built_once_across_nodes_and_the_other_node_waits_then_reads_it(nodes, tmp_path):
    import ray

    from taylor_tune.sweep.tune.leases import start_leases

    cluster = nodes(2)
    cluster.connect()
    location = f"s3://{BUCKET}/leases-once"
    keep = start_leases(f"{location}/importance_cache")  # noqa: F841 (held: the actor lives while its handle does)
    build = build_task()
    results = {}
    for leased in (True, False):
        name = f"entry-{leased}.bin"
        first = build.options(scheduling_strategy=on(cluster.workers[0])).remote(
            f"{location}/importance_cache", name, 4.0, leased, f"{location}/importance_cache", str(tmp_path))
        assert wait_for(lambda: (tmp_path / f"started-{name}").exists(), 120)  # the first builds (holds the lease)
        second = build.options(scheduling_strategy=on(cluster.workers[1])).remote(
            f"{location}/importance_cache", name, 4.0, leased, f"{location}/importance_cache", str(tmp_path))
        results[leased] = ray.get([first, second], timeout=120)
    (a, b) = results[True]
    assert a["node"] != b["node"]  # two nodes
    assert (a["event"], b["event"]) == ("computed", "hit") and a["value"] == b["value"] == f"built on {a['node']}"
    assert b["lease_calls"] >= 1  # it asked, waited on the actor, then read
    log = ray.get(keep.state.remote())["log"]
    assert [(e["event"], e["node"]) for e in log if e["key"].endswith("entry-True.bin")] == [
        ("granted", a["node"]), ("stored", a["node"])]
    said = [(e["event"], e.get("node")) for e in events(f"{location}/importance_cache") if e["key"] == "entry-True"]
    assert said == [("computed", a["node"]), ("hit", b["node"])]
    # the control: without the lease both nodes build the same entry (the check above can fail)
    assert [r["event"] for r in results[False]] == ["computed", "computed"]


def test_a_node_removed_while_it_holds_a_lease_loses_it_to_a_trial_on_another_node(nodes, tmp_path):
    import ray

    from taylor_tune.sweep.tune.leases import start_leases

    cluster = nodes(2)
    cluster.connect()
    location = f"s3://{BUCKET}/leases-lost"
    folder = f"{location}/importance_cache"
    keep = start_leases(folder)
    build = build_task()
    doomed, survivor = cluster.workers
    holding = build.options(scheduling_strategy=on(doomed)).remote(folder, "k.bin", 600.0, True, folder,
                                                                   str(tmp_path))
    assert wait_for(lambda: ray.get(keep.state.remote())["holders"], 60)
    assert ray.get(keep.state.remote())["holders"][f"{bucket(folder)[1]}/k.bin"]["node"] == doomed.node_id
    waiting = build.options(scheduling_strategy=on(survivor)).remote(folder, "k.bin", 1.0, True, folder,
                                                                     str(tmp_path))
    time.sleep(2)  # it waits on the actor: the holder is alive
    cluster.cluster.remove_node(doomed)
    took = ray.get(waiting, timeout=120)
    with pytest.raises(ray.exceptions.RayError):
        ray.get(holding, timeout=60)
    assert took["event"] == "computed" and took["value"] == f"built on {survivor.node_id}"
    log = ray.get(keep.state.remote())["log"]
    # the survivor's lease: a takeover where the actor finds the holder's node dead, or a grant where the dying
    # worker released it on its way out (the node's removal stops it with a signal, and its `finally` runs) before
    # the survivor asked again; seen both ways under load. Either way the lost node's lease went to the survivor.
    taken = log[1]["event"] if len(log) > 1 else None
    assert taken in ("takeover", "granted"), log
    assert [(e["event"], e["node"]) for e in log] == [
        ("granted", doomed.node_id), (taken, survivor.node_id), ("stored", survivor.node_id)]
    said = [(e["event"], e.get("node")) for e in events(folder)]
    assert said == [("takeover", survivor.node_id)] * (taken == "takeover") + [("computed", survivor.node_id)]
    # one whole entry, its checksum beside it, nothing else (no partial upload of the lost node's)
    import hashlib

    filesystem, root = bucket(folder)
    assert [n for n in listing(folder) if not n.startswith("events/")] == ["k.bin", "k.bin.sha256"]
    data = filesystem.open_input_stream(f"{root}/k.bin").read()
    assert filesystem.open_input_stream(f"{root}/k.bin.sha256").read().decode() == hashlib.sha256(data).hexdigest()


GRID = {**SMALL, "models": ["tiny-llama-random"],
        "search_space": {"taylor_seq_len": {"grid": [16, 32]}, "taylor_num_samples": {"grid": [8]},
                         "pruning_method": {"grid": ["taylor", "blockwise"]}},
        "search": {"algorithm": "grid", "max_concurrent": 2}, "max_failures": 2}


def cluster_sweep(tmp_path: Path, name: str, storage: str, address: str, **changes) -> subprocess.Popen:
    experiment = tmp_path / f"{name}.yaml"
    experiment.write_text(yaml.safe_dump({"name": name, **GRID, "storage_path": storage, **changes}))
    return subprocess.Popen([sys.executable, "-m", "taylor_tune", "sweep", str(experiment)], cwd=REPO,
                            env={**env(), "RAY_ADDRESS": address, "TAYLOR_TUNE_METRICS_FLUSH_S": "0"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def final_results(folder: str) -> dict[str, dict]:
    """The trials of an experiment in storage whose evaluation.json is written: {trial folder: its result.json}."""
    filesystem, root = bucket(folder)
    names = listing(folder)
    done = {}
    for name in names:
        trial, _, file = name.rpartition("/")
        if file == "evaluation.json" and f"{trial}/result.json" in names:
            done[trial] = filesystem.open_input_stream(f"{root}/{trial}/result.json").read()
    return done


def test_a_sweep_on_the_cluster_computes_each_pass_and_each_tasks_requests_once_across_nodes(nodes, tmp_path):
    cluster = nodes(2)
    storage = f"s3://{BUCKET}/cluster"
    proc = cluster_sweep(tmp_path, "grid", storage, cluster.cluster.address)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    folder = f"{storage}/grid"
    assert len(final_results(folder)) == 4
    passes = events(f"{folder}/importance_cache")
    computed = [e["key"] for e in passes if e["event"] == "computed"]
    assert len(computed) == len(set(computed)) == 2  # two seq_len: two passes, each once across the nodes
    assert sum(e["event"] == "hit" for e in passes) == 2 and not any(e["event"] == "damaged" for e in passes)
    requests = events(f"{folder}/requests")
    assert [e["event"] for e in requests].count("computed") == 1  # piqa's requests for the model, once
    assert sum(e["event"] == "hit" for e in requests) == 3
    workers = {node.node_id for node in cluster.workers}
    assert {e["node"] for e in passes + requests} == workers  # both nodes ran trials; the head ran none
    names = listing(folder)
    assert not any(".lock" in n for n in names)  # no lock files: the leases are Ray's


def test_a_node_removed_mid_pass_loses_its_lease_and_the_sweep_finishes_every_trial(nodes, tmp_path):
    import ray

    from taylor_tune.sweep.tune.leases import NAMESPACE, actor_name

    # every importance pass waits 20 s under its lease: the window in which the holder's node is removed
    faults = str(Path(__file__).resolve().parent / "faults")
    cluster = nodes(2, TAYLOR_TUNE_TEST_SLOW_PASS="20",
                    PYTHONPATH=os.pathsep.join(filter(None, [faults, os.environ.get("PYTHONPATH")])))
    storage = f"s3://{BUCKET}/node-lost"
    folder = f"{storage}/grid"
    proc = cluster_sweep(tmp_path, "grid", storage, cluster.cluster.address)
    cluster.connect()

    def holders() -> dict:
        try:
            actor = ray.get_actor(actor_name(f"{folder}/importance_cache"), namespace=NAMESPACE)
            return ray.get(actor.state.remote())["holders"]
        except ValueError:
            return {}

    assert wait_for(lambda: holders() or proc.poll() is not None, 300, poll=0.5)
    held = next(iter(holders().values()))
    doomed = next(node for node in cluster.workers if node.node_id == held["node"])
    cluster.cluster.remove_node(doomed)  # its trial dies mid-pass, its lease with it
    cluster.workers.append(cluster.add())  # a replacement node joins, as an autoscaler's would
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    assert len(final_results(folder)) == 4  # every trial finished
    passes = events(f"{folder}/importance_cache")
    computed = [e["key"] for e in passes if e["event"] == "computed"]
    assert len(computed) == len(set(computed)) == 2 and not any(e["event"] == "damaged" for e in passes)
    took = [e for e in passes if e["event"] == "takeover"]
    assert len(took) == 1 and took[0]["node"] != doomed.node_id
    entries = [n for n in listing(f"{folder}/importance_cache") if n.endswith(".safetensors")]
    assert len(entries) == 2  # one entry per key: none duplicated, none partial


def test_a_killed_driver_resumes_from_the_bucket_alone_without_rerunning_finished_trials(s3, tmp_path):
    """Must-show 3, the driver: a raced sweep on s3 whose driver is SIGKILLed after some trials finished; resumed
    with a fresh Ray temp folder and from another working directory (nothing local carried over): the finished trials
    are not run again (their results untouched) and every decision the race had made stands."""
    from taylor_tune.storage.names import RACE_FILE
    from tests.sweep.test_race_sweep import ALPHA, TASKS

    storage = f"s3://{BUCKET}/killed"
    folder = f"{storage}/race"
    raced = {**SMALL, "models": ["tiny-llama-random"],
             "search_space": {"taylor_seq_len": {"grid": [16, 32]}, "taylor_num_samples": {"grid": [8]},
                              "pruning_method": {"grid": ["taylor", "blockwise"]}},
             "search": {"algorithm": "grid", "scheduler": "race", "alpha": ALPHA, "max_concurrent": 1},
             "evaluation": {"tasks": ",".join(TASKS), "task_data": "world", "ppl": None, "batch_size": 16,
                            "fidelities": [20, 60, None], "speed": None}}
    runs = []
    for attempt in ("first", "second"):
        work = tmp_path / attempt  # its own working directory and Ray temp root
        work.mkdir()
        experiment = work / "race.yaml"
        experiment.write_text(yaml.safe_dump({"name": "race", **raced, "storage_path": storage}))
        temp = Path("/tmp") / f"ttk-{os.getpid()}-{attempt[0]}"
        runs.append((work, experiment, temp))
    work, experiment, temp = runs[0]
    started = time.time()
    first = subprocess.Popen([sys.executable, "-m", "taylor_tune", "sweep", str(experiment)], cwd=work,
                             env={**env(), "RAY_TMPDIR": str(temp), "PYTHONPATH": str(REPO)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert wait_for(lambda: len(final_results(folder)) >= 2 or first.poll() is not None, 600)
    time.sleep(3)  # Tune's saved state (every second) records them finished
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    kill_ray_started_after(started, temp)
    before = final_results(folder)
    filesystem, root = bucket(folder)
    decided = json.loads(filesystem.open_input_stream(f"{root}/{RACE_FILE}").read())["decisions"]
    assert 2 <= len(before) < 4, "the sweep must be killed part-way for this test to mean anything"
    shutil.rmtree(temp, ignore_errors=True)

    work, experiment, temp = runs[1]
    started = time.time()
    second = subprocess.run([sys.executable, "-m", "taylor_tune", "sweep", str(experiment)], cwd=work,
                            env={**env(), "RAY_TMPDIR": str(temp), "PYTHONPATH": str(REPO)}, capture_output=True,
                            text=True, timeout=900)
    kill_ray_started_after(started, temp)
    shutil.rmtree(temp, ignore_errors=True)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    after = final_results(folder)
    assert all(after[trial] == result for trial, result in before.items())  # none rerun: results untouched
    trials = {name.split("/")[0] for name in listing(folder) if name.endswith("/result.json")}
    assert len(trials) == 4  # the rest ran: finished, or stopped by the race
    now = json.loads(filesystem.open_input_stream(f"{root}/{RACE_FILE}").read())["decisions"]
    for model, decisions in decided.items():
        assert all(decision in now[model] for decision in decisions)  # every decision stands
