"""The importance cache: entries read back as written, keyed by every field, damaged ones computed again, a lock
waited on, taken over when stale and kept alive by its owner's heartbeat (in one process, fast), and across
processes (slow): one computes while another waits, a live owner keeps its lock, a killed owner's lock is taken over.
Real files; only the compute step is a stand-in."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from taylor_tune.pruning.activations import ActivationStats, FeatureStats
from taylor_tune.pruning.importance import Importance
from taylor_tune.pruning.importance_cache import (
    CHECKSUM,
    ImportanceCache,
    cache_key,
    read_checked,
    stats_from_tensors,
    stats_to_tensors,
    tensors_sha256,
)
from taylor_tune.pruning.plan import GroupScores
from taylor_tune.storage.cache import Store
from tests.sweep_helpers import REPO, wait_for


def worker(root, seconds, out, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "tests.cache_worker", str(root), str(seconds), str(out), *map(str, extra)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def events(root):
    return [event["event"] for event in Store(root).events()]


def computes(root):
    return (root / "computes").read_text().split() if (root / "computes").is_file() else []


@pytest.mark.slow  # two Python processes that import torch
def test_two_processes_compute_once_and_both_get_the_scores(tmp_path):
    root = tmp_path / "cache"
    first = worker(root, 2.0, tmp_path / "a.json")
    assert wait_for(lambda: computes(root), 60)  # the first one holds the lock
    second = worker(root, 2.0, tmp_path / "b.json")
    assert first.wait(60) == 0 and second.wait(60) == 0, first.stderr.read() + second.stderr.read()
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert (a["event"], b["event"]) == ("computed", "hit")
    assert a["mlp"] == b["mlp"] == [3.0, 4.0, 5.0]
    assert computes(root) == [str(first.pid)] and sorted(events(root)) == ["computed", "hit"]
    assert not list(root.glob("*.lock")) and not list(root.glob(".*.tmp"))


@pytest.mark.slow  # two Python processes that import torch
def test_a_live_owner_keeps_its_lock_past_the_stale_age_by_its_heartbeat(tmp_path):
    root = tmp_path / "cache"
    options = ("--heartbeat-s", 0.2, "--stale-s", 1.0)
    first = worker(root, 3.0, tmp_path / "a.json", *options)  # computes three times longer than the stale age
    assert wait_for(lambda: computes(root), 60)
    second = worker(root, 3.0, tmp_path / "b.json", *options)
    assert first.wait(60) == 0 and second.wait(60) == 0, first.stderr.read() + second.stderr.read()
    assert "takeover" not in events(root) and len(computes(root)) == 1
    assert json.loads((tmp_path / "b.json").read_text())["event"] == "hit"


@pytest.mark.slow  # two Python processes that import torch
def test_a_killed_owners_lock_goes_stale_and_is_taken_over(tmp_path):
    root = tmp_path / "cache"
    options = ("--heartbeat-s", 0.2, "--stale-s", 1.0)
    doomed = worker(root, 600, tmp_path / "a.json", *options)
    assert wait_for(lambda: computes(root), 60)
    os.kill(doomed.pid, signal.SIGKILL)  # mid-compute: the lock stays, its heartbeat stops
    doomed.wait(10)
    assert list(root.glob("*.lock"))
    started = time.monotonic()
    heir = worker(root, 0.1, tmp_path / "b.json", *options)
    assert heir.wait(60) == 0, heir.stderr.read()
    assert time.monotonic() - started >= 1.0  # it waited for the lock to go stale
    assert json.loads((tmp_path / "b.json").read_text()) == {"event": "computed", "mlp": [3.0, 4.0, 5.0]}
    assert events(root) == ["takeover", "computed"] and computes(root) == [str(doomed.pid), str(heir.pid)]
    assert not (tmp_path / "a.json").exists() and not list(root.glob("*.lock")) and not list(root.glob(".*.tmp"))


# In one process (fast): the entry, its key, damage, and the lock, with threads standing in for other trials.

def importance(n: int, seed: int, layers: int = 3) -> Importance:
    rng = np.random.default_rng(seed)
    scores = GroupScores(tuple(rng.random(2) for _ in range(layers)), tuple(rng.random(5) for _ in range(layers)))
    return Importance(n, scores, rng.random(layers), rng.random(layers))


def assert_same(got: dict[int, Importance], want: dict[int, Importance]) -> None:
    assert sorted(got) == sorted(want)
    for n in want:
        g, w = got[n], want[n]
        assert g.num_samples == w.num_samples == n
        for ours, theirs in zip((*g.scores.attn, *g.scores.mlp, g.grad_mean, g.grad_norm),
                                (*w.scores.attn, *w.scores.mlp, w.grad_mean, w.grad_norm), strict=True):
            assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)  # bit for bit


class Compute:
    """A compute step that counts its calls (and can wait for a signal, or fail)."""

    def __init__(self, results, release: threading.Event | None = None, error: Exception | None = None,
                 during=None):
        self.results, self.release, self.error, self.calls, self.during = results, release, error, 0, during
        self.started = threading.Event()

    def __call__(self):
        self.calls += 1
        self.started.set()
        if self.during is not None:
            self.during()
        if self.release is not None:
            assert self.release.wait(30)
        if self.error is not None:
            raise self.error
        return self.results


FIELDS = {"model": "tiny-llama", "calibration": "world", "seq_len": 32, "seed": 0, "dtype": "float32",
          "device": "cpu", "micro_batch_size": 4}


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.suffix in (".lock", ".tmp"))


def test_an_entry_reads_back_bit_for_bit_and_is_computed_once(tmp_path):
    root, results = tmp_path / "sweep" / "cache", {4: importance(4, 0), 8: importance(8, 1)}  # parents made too
    lock = root / f"{cache_key(**FIELDS, counts=[4, 8])}.lock"
    held_by = []
    compute = Compute(results, during=lambda: (held_by.append(json.loads(lock.read_text())), time.sleep(0.05)))
    cache, before = ImportanceCache(root), time.time()
    assert cache.counters() == {"computed": 0, "hits": 0, "takeovers": 0} and cache.last_event is None  # nothing yet
    started = time.perf_counter()
    assert_same(cache.get_or_compute(FIELDS, [4, 8], compute), results)
    elapsed = time.perf_counter() - started
    assert held_by == [{"host": socket.gethostname(), "pid": os.getpid()}]  # the lock says who holds it
    assert cache.last_event == "computed" and compute.calls == 1
    again = ImportanceCache(root)  # another trial: counts in another order, fields in another order
    assert_same(again.get_or_compute(dict(reversed(FIELDS.items())), [8, 4], Compute(None)), results)
    assert again.last_event == "hit" and cache.counters() == {"computed": 1, "hits": 1, "takeovers": 0}
    (entry,) = root.glob("*.safetensors")
    with safe_open(str(entry), framework="pt") as handle:  # the fields are readable in the entry itself
        assert {k: handle.metadata()[k] for k in FIELDS} == {k: str(v) for k, v in FIELDS.items()}
    events = Store(root).events()
    assert [e["event"] for e in events] == ["computed", "hit"] and events[0]["key"] == events[1]["key"]
    assert all(e["pid"] == os.getpid() and e["host"] == socket.gethostname() for e in events)
    assert before <= events[0]["time"] <= events[1]["time"] <= time.time()
    assert events[0]["seq_len"] == "32" and 0.05 <= events[0]["seconds"] <= elapsed  # the compute's own time
    assert leftovers(root) == []


def test_every_field_and_the_sample_counts_are_part_of_the_key(tmp_path):
    cache = ImportanceCache(tmp_path / "cache")
    cache.get_or_compute(FIELDS, [4, 8], Compute({4: importance(4, 0), 8: importance(8, 1)}))
    others = [{**FIELDS, name: f"other {value}"} for name, value in FIELDS.items()] + [{**FIELDS, "extra": 1}]
    for fields in others:
        cache.get_or_compute(fields, [4, 8], Compute({4: importance(4, 2), 8: importance(8, 3)}))
        assert cache.last_event == "computed", fields
    cache.get_or_compute(FIELDS, [4], Compute({4: importance(4, 2)}))  # a subset of the counts: another entry
    assert cache.last_event == "computed"
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == len(others) + 2


def test_the_checksum_covers_each_tensors_name_dtype_shape_and_every_byte():
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int64)}
    base = tensors_sha256(tensors)
    assert tensors_sha256(dict(reversed(tensors.items()))) == base  # not the order of the dict
    assert tensors_sha256({**tensors, "a": tensors["a"].t().contiguous().t()}) == base  # nor the memory layout
    changed = [{"c": tensors["a"], "b": tensors["b"]}, {**tensors, "a": tensors["a"].double()},
               {**tensors, "a": tensors["a"].reshape(3, 2)}, {**tensors, "b": torch.tensor([1, 3])},
               {**tensors, "c": torch.zeros(0)}]
    for byte in range(24):  # each byte of "a" alone
        raw = tensors["a"].clone().reshape(-1).view(torch.uint8)
        raw[byte] ^= 1
        changed.append({**tensors, "a": raw.view(torch.float32).reshape(2, 3)})
    digests = [tensors_sha256(t) for t in changed]
    assert base not in digests and len(set(digests)) == len(digests)


def test_an_entry_without_its_checksum_or_with_another_one_is_refused(tmp_path):
    tensors = {"x": torch.ones(3)}
    save_file(tensors, str(tmp_path / "none.safetensors"))
    with pytest.raises(ValueError, match="carries no checksum"):
        read_checked((tmp_path / "none.safetensors").read_bytes())
    save_file({"x": torch.zeros(3)}, str(tmp_path / "other.safetensors"), metadata={CHECKSUM: tensors_sha256(tensors)})
    with pytest.raises(ValueError, match="do not match their checksum"):
        read_checked((tmp_path / "other.safetensors").read_bytes())
    save_file(tensors, str(tmp_path / "ok.safetensors"), metadata={CHECKSUM: tensors_sha256(tensors)})
    assert torch.equal(read_checked((tmp_path / "ok.safetensors").read_bytes())["x"], tensors["x"])


@pytest.mark.parametrize("damage", ["a byte flipped", "cut short", "rejected by the check"])
def test_a_damaged_entry_is_logged_removed_and_computed_again(tmp_path, caplog, damage):
    root, results = tmp_path / "cache", {8: importance(8, 0)}
    ImportanceCache(root).get_or_compute(FIELDS, [8], Compute(results))
    (entry,) = root.glob("*.safetensors")
    data = bytearray(entry.read_bytes())
    if damage == "a byte flipped":
        data[-3] ^= 0xFF
    entry.write_bytes(bytes(data[:-8] if damage == "cut short" else data))

    def check(imp):
        if damage == "rejected by the check":
            raise ValueError("scores of another shape")

    cache, compute = ImportanceCache(root), Compute({8: importance(8, 5)})
    with caplog.at_level("WARNING"):
        assert_same(cache.get_or_compute(FIELDS, [8], compute, check=check), {8: importance(8, 5)})
    assert compute.calls == 1 and cache.last_event == "computed"
    events = Store(root).events()
    assert [e["event"] for e in events] == ["computed", "damaged", "computed"]
    assert events[1]["error"].startswith(("ValueError: ", "SafetensorError: ")) and events[1]["key"] in entry.name
    assert f"cache entry {entry} is refused ({events[1]['error']}); removed, building it again" in caplog.text
    assert cache.counters() == {"computed": 2, "hits": 0, "takeovers": 0}  # a damaged entry is not a hit
    assert_same(ImportanceCache(root).get_or_compute(FIELDS, [8], Compute(None)), {8: importance(8, 5)})


def damaged_entry(root: Path) -> tuple[Path, bytes]:
    """An entry whose checksum does not match (a byte of its tensors flipped), and its bytes."""
    ImportanceCache(root).get_or_compute(FIELDS, [8], Compute({8: importance(8, 0)}))
    (entry,) = root.glob("*.safetensors")
    data = bytearray(entry.read_bytes())
    data[-3] ^= 0xFF
    entry.write_bytes(bytes(data))
    return entry, bytes(data)


def test_an_entry_found_damaged_a_second_time_is_an_error_not_a_loop(tmp_path):
    """Damaged, removed; meanwhile another trial holds the lock and writes the entry damaged again: the second
    damage is raised (a state to look at), not removed and computed forever."""
    root = tmp_path / "cache"
    entry, data = damaged_entry(root)
    lock = root / f"{cache_key(**FIELDS, counts=[8])}.lock"
    lock.write_text("{}")  # the other trial's, live

    def other_trial():
        assert wait_for(lambda: not entry.exists(), 30)  # this trial removed the damaged entry
        # written as the cache writes (a temporary file renamed into place): a plain write_bytes let this trial read
        # the entry half-written once, under load, and fail on its header instead of on the planted damage
        tmp = entry.with_name(f".{entry.name}.other.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, entry)
        lock.unlink()

    writer = threading.Thread(target=other_trial)
    writer.start()
    compute = Compute({8: importance(8, 1)})
    with pytest.raises(ValueError, match="do not match their checksum"):
        ImportanceCache(root, poll_s=0.01).get_or_compute(FIELDS, [8], compute)
    writer.join(30)
    assert compute.calls == 0


def test_an_entry_written_between_the_look_and_the_lock_is_read_not_computed_again(tmp_path, monkeypatch):
    """Another trial finishes (its entry written, its lock let go) in the instant between this trial's look for the
    entry and its taking the lock: this trial reads that entry and computes nothing. (Found as a flaky failure of the
    test above under load: the other trial's write landed in that window and this one computed again.)"""
    from taylor_tune.storage import cache as storage

    root = tmp_path / "cache"
    ImportanceCache(root).get_or_compute(FIELDS, [8], Compute({8: importance(8, 3)}))
    (entry,) = root.glob("*.safetensors")
    data = entry.read_bytes()
    entry.unlink()
    real_open = os.open

    def the_other_trial_finishes_first(path, flags, *args):
        if str(path).endswith(".lock") and not entry.exists():
            entry.write_bytes(data)
        return real_open(path, flags, *args)

    monkeypatch.setattr(storage.os, "open", the_other_trial_finishes_first)
    compute = Compute({8: importance(8, 1)})
    assert_same(ImportanceCache(root).get_or_compute(FIELDS, [8], compute), {8: importance(8, 3)})
    assert compute.calls == 0 and not list(root.glob("*.lock"))


def test_a_damaged_entry_that_another_trial_removes_first_is_computed_again(tmp_path):
    """Two trials find the entry damaged at once; the other removes it between this one's warning and its removal."""
    root = tmp_path / "cache"
    entry, _ = damaged_entry(root)
    removed = []

    class RemovesTheEntry(logging.Handler):
        def emit(self, record):
            entry.unlink()
            removed.append(record.getMessage())

    handler = RemovesTheEntry(logging.WARNING)
    logging.getLogger("taylor_tune.storage").addHandler(handler)
    try:
        cache = ImportanceCache(root)
        cache.get_or_compute(FIELDS, [8], Compute({8: importance(8, 1)}))
    finally:
        logging.getLogger("taylor_tune.storage").removeHandler(handler)
    assert len(removed) == 1 and cache.last_event == "computed" and entry.is_file()


def test_a_trial_waits_for_the_one_computing_and_reads_its_entry(tmp_path):
    root, results, release = tmp_path / "cache", {8: importance(8, 0)}, threading.Event()
    owner = Compute(results, release)
    first = threading.Thread(target=ImportanceCache(root).get_or_compute, args=(FIELDS, [8], owner))
    first.start()
    assert owner.started.wait(30)
    second, waited = ImportanceCache(root, poll_s=0.01), Compute(None)
    threading.Timer(0.2, release.set).start()
    got = second.get_or_compute(FIELDS, [8], waited)
    first.join(30)
    assert_same(got, results)
    assert second.last_event == "hit" and waited.calls == 0 and owner.calls == 1
    assert second.counters() == {"computed": 1, "hits": 1, "takeovers": 0} and leftovers(root) == []


def test_the_owner_refreshes_its_lock_while_it_computes_and_stops_after(tmp_path):
    """The heartbeat that keeps a live owner's lock younger than the stale age (the waiting side, against real
    processes, is the slow test above): the lock aged by 100 s during the compute is fresh again a few beats later."""
    root = tmp_path / "cache"
    lock = root / f"{cache_key(**FIELDS, counts=[8])}.lock"
    ages = []

    def age_the_lock_and_look_again():
        old = time.time() - 100
        os.utime(lock, (old, old))
        time.sleep(0.4)  # eight beats of 0.05 s
        ages.append(time.time() - lock.stat().st_mtime)

    ImportanceCache(root, heartbeat_s=0.05).get_or_compute(
        FIELDS, [8], Compute({8: importance(8, 0)}, during=age_the_lock_and_look_again))
    assert ages[0] < 50 and not lock.exists()


def test_a_lock_that_stopped_beating_is_taken_over(tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    key = cache_key(**FIELDS, counts=[8])
    lock = root / f"{key}.lock"
    lock.write_text("{}")
    os.utime(lock, (time.time() - 10, time.time() - 10))  # a killed owner's, 10 s old
    cache, compute = ImportanceCache(root, stale_s=5), Compute({8: importance(8, 0)})
    cache.get_or_compute(FIELDS, [8], compute)
    assert compute.calls == 1 and cache.counters() == {"computed": 1, "hits": 0, "takeovers": 1}
    lock.write_text("{}")  # a live one (just written), younger than the stale age: waited on, not taken
    waiter = ImportanceCache(root, poll_s=0.01, stale_s=5)
    threading.Timer(0.1, lock.unlink).start()
    (root / f"{key}.safetensors").unlink()
    waiter.get_or_compute(FIELDS, [8], Compute({8: importance(8, 0)}))
    assert waiter.counters()["takeovers"] == 1 and waiter.last_event == "computed"


def test_a_compute_that_fails_leaves_no_lock_no_entry_and_the_next_trial_computes(tmp_path):
    root = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="out of memory"):
        ImportanceCache(root).get_or_compute(FIELDS, [8], Compute(None, error=RuntimeError("out of memory")))
    assert leftovers(root) == [] and not list(root.glob("*.safetensors"))
    cache = ImportanceCache(root, stale_s=3600)  # a lock left behind would make this wait an hour
    cache.get_or_compute(FIELDS, [8], Compute({8: importance(8, 0)}))
    assert cache.last_event == "computed"


def test_an_owner_whose_lock_was_taken_from_it_still_stores_and_returns_its_scores(tmp_path):
    """A slow owner's lock judged stale and removed by another trial while it computes: its finished scores are
    still written and returned; the missing lock is no error."""
    root = tmp_path / "cache"
    lock = root / f"{cache_key(**FIELDS, counts=[8])}.lock"
    cache = ImportanceCache(root)
    assert_same(cache.get_or_compute(FIELDS, [8], Compute({8: importance(8, 0)}, during=lock.unlink)),
                {8: importance(8, 0)})
    assert cache.last_event == "computed" and not lock.exists()
    assert_same(ImportanceCache(root).get_or_compute(FIELDS, [8], Compute(None)), {8: importance(8, 0)})


def test_activation_statistics_and_extra_tensors_go_through_the_same_entry(tmp_path):
    rng = np.random.default_rng(0)
    part = lambda width: FeatureStats(int(rng.integers(1, 1000)), rng.random(width), rng.random(width))
    stats = {4: ActivationStats((part(6), part(6)), (part(9), part(9))), 8: ActivationStats((part(6), part(6)),
                                                                                           (part(9), part(9)))}
    root = tmp_path / "cache"
    for event in ("computed", "hit"):
        cache = ImportanceCache(root)
        got = cache.get_or_compute(FIELDS, [4, 8], Compute(stats), extra_tensors=lambda: {"also": torch.ones(2)},
                                   encode=stats_to_tensors, decode=stats_from_tensors)
        assert cache.last_event == event and sorted(got) == [4, 8]
        for n in stats:
            for ours, theirs in zip(got[n].attn + got[n].mlp, stats[n].attn + stats[n].mlp, strict=True):
                assert ours.tokens == theirs.tokens and type(ours.tokens) is int
                assert np.array_equal(ours.mean, theirs.mean) and np.array_equal(ours.m2, theirs.m2)
    (entry,) = root.glob("*.safetensors")
    assert torch.equal(read_checked(entry.read_bytes())["also"], torch.ones(2))
