"""The importance cache across processes: one computes while another waits, a live owner keeps its lock, and a
killed owner's lock goes stale and is taken over. Real processes, real files; only the compute step is fake."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.sweep_helpers import REPO, wait_for

pytestmark = pytest.mark.slow  # each case starts two Python processes that import torch


def worker(root, seconds, out, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "tests.cache_worker", str(root), str(seconds), str(out), *map(str, extra)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def events(root):
    return [json.loads(line)["event"] for line in (root / "events.jsonl").read_text().splitlines()]


def computes(root):
    return (root / "computes").read_text().split() if (root / "computes").is_file() else []


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


def test_a_live_owner_keeps_its_lock_past_the_stale_age_by_its_heartbeat(tmp_path):
    root = tmp_path / "cache"
    options = ("--heartbeat-s", 0.2, "--stale-s", 1.0)
    first = worker(root, 3.0, tmp_path / "a.json", *options)  # computes three times longer than the stale age
    assert wait_for(lambda: computes(root), 60)
    second = worker(root, 3.0, tmp_path / "b.json", *options)
    assert first.wait(60) == 0 and second.wait(60) == 0, first.stderr.read() + second.stderr.read()
    assert "takeover" not in events(root) and len(computes(root)) == 1
    assert json.loads((tmp_path / "b.json").read_text())["event"] == "hit"


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
