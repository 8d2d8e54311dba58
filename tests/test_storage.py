"""storage.Store on its own, fast: JSON entries built once and refused when damaged, transient storage errors retried
and counted (a filesystem that fails on cue around the real local one), node copies read by checksum, events as
objects. The same store on a real S3 server and under Ray's leases: tests/test_object_storage.py, tests/test_cluster.py.
"""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
from pyarrow import fs

from taylor_tune.jsonio import entry_text, read_entry
from taylor_tune.storage import cache as storage
from taylor_tune.storage.cache import Store, built_json, counters, is_transient, json_name


class Flaky:
    """A pyarrow filesystem (duck-typed: not local, so the store treats it as object storage) whose next calls raise
    the errors in `failures`, in turn."""

    def __init__(self, failures=()):
        self.inner, self.failures, self.calls = fs.LocalFileSystem(), list(failures), 0

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def call(*args, **kwargs):
            self.calls += 1
            if self.failures:
                raise self.failures.pop(0)
            if name == "open_output_stream":
                self.inner.create_dir(args[0].rsplit("/", 1)[0], recursive=True)
            return method(*args, **kwargs)

        return call


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_an_entry_refuses_a_payload_json_cannot_hold_and_stores_nothing(tmp_path, bad):
    with pytest.raises(ValueError):
        entry_text({}, "value", [1.0, bad])
    with pytest.raises(ValueError):
        built_json(Store(tmp_path), {"a": 1}, lambda: {"x": bad}, dict)
    assert not (tmp_path / json_name({"a": 1})).exists()


def test_an_entry_written_in_the_documented_form_is_read_not_built_again(tmp_path):
    (tmp_path / json_name({"a": [1, 2]})).write_text(entry_text({"a": [1, 2]}, "value", {"x": 1}))
    value, built = built_json(Store(tmp_path), {"a": (1, 2)}, lambda: pytest.fail("built again"), dict)
    assert (value, built) == ({"x": 1}, False)


def test_a_refused_entry_is_logged_with_its_path_and_the_readers_error_then_built_once(tmp_path, caplog):
    path = tmp_path / json_name({"a": 1})
    path.write_text(entry_text({"a": 1}, "value", [1, 2]))
    reasons = iter([KeyError("x" * 500)])

    def read(value):
        error = next(reasons, None)
        if error is not None:
            raise error
        return value

    builds = []
    with caplog.at_level(logging.WARNING, logger=storage.__name__):
        value, built = built_json(Store(tmp_path), {"a": 1}, lambda: builds.append(1) or [3], read)
    assert (value, built, builds) == ([3], True, [1])
    assert read_entry(path.read_text(), {"a": 1}, "value") == [3]
    (record,) = caplog.records
    message = record.getMessage()
    assert str(path) in message and "KeyError" in message
    assert str(KeyError("x" * 500))[:200] in message and str(KeyError("x" * 500))[:201] not in message
    assert [e["event"] for e in Store(tmp_path).events()] == ["damaged", "computed"]


@pytest.mark.parametrize("error,transient", [
    (OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 28, Timeout was reached"), True),
    (OSError("When reading information for key 'k': AWS Error SLOW_DOWN (HTTP status code 503)"), True),
    (TimeoutError("read timed out"), True),
    (OSError("AWS Error ACCESS_DENIED during PutObject operation: Access Denied"), False),
    (FileNotFoundError("no such key"), False),
])
def test_what_counts_as_a_transient_storage_error(error, transient):
    assert is_transient(error) is transient


def test_transient_errors_are_retried_with_backoff_and_counted_and_others_are_not(tmp_path, monkeypatch):
    slept = []
    monkeypatch.setattr(storage.time, "sleep", slept.append)
    flaky = Flaky([OSError("HTTP status code 503: SlowDown")] * 2)
    store = Store(str(tmp_path), filesystem=flaky, backoff_s=0.5)
    store.write("a.bin", b"abc")
    assert (tmp_path / "a.bin").read_bytes() == b"abc"
    assert store.stats.storage_retries == 2 and slept == [0.5, 1.0]  # doubling
    assert store.stats.bytes_written == 3
    flaky.failures = [OSError("AWS Error ACCESS_DENIED: Access Denied")]
    with pytest.raises(OSError, match="ACCESS_DENIED"):
        store.read("a.bin")
    assert store.stats.storage_retries == 2  # not retried
    flaky.failures = [OSError("connection reset by peer")] * 10
    with pytest.raises(OSError, match="connection reset"):
        store.read("a.bin")
    assert store.stats.storage_retries == 2 + store.retries  # gave up after its retries


def test_a_node_reads_an_entry_from_storage_once_then_from_its_copy_named_by_checksum(tmp_path):
    flaky, copies = Flaky(), tmp_path / "node-copies"
    first = Store(str(tmp_path / "bucket"), filesystem=flaky, copies=copies)
    data = b"x" * 10_000
    value, event = first.built_once("k.bin", lambda: data, bytes)
    assert (value, event) == (data, "computed")
    sha = hashlib.sha256(data).hexdigest()
    assert (tmp_path / "bucket" / "k.bin.sha256").read_text() == sha
    second = Store(str(tmp_path / "bucket"), filesystem=flaky, copies=copies)  # another trial on the node
    assert second.built_once("k.bin", pytest.fail, bytes) == (data, "hit")
    assert second.stats.bytes_read == 64 + len(data) and (copies / sha).read_bytes() == data  # the sidecar, then it
    third = Store(str(tmp_path / "bucket"), filesystem=flaky, copies=copies)
    assert third.built_once("k.bin", pytest.fail, bytes) == (data, "hit")
    assert third.stats.bytes_read == 64 and third.stats.copy_hits == 1  # the sidecar only
    (copies / sha).write_bytes(b"y" * 10_000)  # a copy changed on the node: not used
    fourth = Store(str(tmp_path / "bucket"), filesystem=flaky, copies=copies)
    assert fourth.built_once("k.bin", pytest.fail, bytes) == (data, "hit")
    assert fourth.stats.copy_hits == 0 and fourth.stats.bytes_read == 64 + len(data)


def test_each_event_is_an_object_of_its_own_and_an_older_sweeps_log_is_read_too(tmp_path):
    (tmp_path / "events.jsonl").write_text(json.dumps({"event": "computed", "key": "old", "time": 1.0}) + "\n")
    store = Store(tmp_path)
    store.built_once("k.safetensors", lambda: b"1", bytes)
    store.built_once("k.safetensors", pytest.fail, bytes)
    assert len(list((tmp_path / "events").iterdir())) == 2
    events = store.events()
    assert [(e["event"], e["key"]) for e in events] == [("computed", "old"), ("computed", "k"), ("hit", "k")]
    assert counters(events) == {"computed": 2, "hits": 1, "takeovers": 0}


def test_a_sweep_pickled_before_storage_had_its_room_resumes_with_its_storage_check():
    """Tune pickles a sweep's callbacks into tuner.pkl, and the console's watch of a full disk names its check by
    where it was defined: `taylor_tune.sweep.folder.storage_full` before the storage room. A resume of such a sweep
    unpickles that name (here the bytes such a pickle holds for it)."""
    import pickle

    from taylor_tune.storage.location import storage_full

    assert pickle.loads(b"ctaylor_tune.sweep.folder\nstorage_full\n.") is storage_full


def test_a_trials_file_is_read_only_as_a_regular_file_of_its_own(tmp_path):
    """What the export rebuilds from (a trial's config.json, params.json, pruning summary) is read as every file of a
    sweep is: a symbolic link, or a file hard-linked with another, planted in the trial's folder is not read."""
    import os

    from taylor_tune.storage.folder import trial_file

    trial, outside = tmp_path / "trial", tmp_path / "outside.json"
    trial.mkdir()
    outside.write_text('{"secret": 1}')
    (trial / "config.json").write_text('{"model": "tiny-llama"}')
    assert trial_file(str(trial), "config.json") == (f"{trial}/config.json", '{"model": "tiny-llama"}')
    (trial / "params.json").symlink_to(outside)
    os.link(outside, trial / "pruning_summary.json")
    for name in ("params.json", "pruning_summary.json", "missing.json"):
        with pytest.raises(FileNotFoundError, match="not a regular file of the trial's own"):
            trial_file(str(trial), name)


def test_a_running_trials_copies_from_storage_read_only_regular_files_of_their_own(tmp_path):
    """What a rerun copies back from the sweep's folder (a finished trial's artifacts, another trial's config.json
    found by its content, a trial's result.json) is read as every file of a sweep is: a symbolic link planted there
    is neither copied nor matched, and its target is not read."""
    from taylor_tune.storage.folder import copy_out, restore, sibling_folders_holding

    local, experiment, outside = fs.LocalFileSystem(), tmp_path / "experiment", tmp_path / "outside.json"
    outside.write_text('{"model": "tiny-llama"}')
    own, plain, linked = (experiment / name for name in ("own", "plain", "linked"))
    for folder in (own, plain, linked):
        folder.mkdir(parents=True)
    (plain / "config.json").write_text('{"model": "tiny-llama"}')
    (linked / "config.json").symlink_to(outside)
    assert list(sibling_folders_holding(local, str(own), "config.json", {"model": "tiny-llama"})) == [str(plain)]

    into = tmp_path / "into"
    into.mkdir()
    assert copy_out(local, str(plain), ["config.json"], into) and (into / "config.json").read_text() == \
        '{"model": "tiny-llama"}'
    (into / "config.json").unlink()
    assert not copy_out(local, str(linked), ["config.json"], into) and not (into / "config.json").exists()

    assert restore(local, str(plain / "config.json"), tmp_path / "back" / "result.json")
    assert (tmp_path / "back" / "result.json").read_text() == '{"model": "tiny-llama"}'
    assert not restore(local, str(linked / "config.json"), tmp_path / "gone" / "result.json")
    assert not (tmp_path / "gone").exists()
