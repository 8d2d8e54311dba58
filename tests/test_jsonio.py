"""jsonio on its own, fast: numbers as JSON against a decoder written here, digests against reordered and re-typed
copies, and the trust boundary of a shared folder (links planted at a name, or under a temporary name between its
removal and its creation) against the files they point at. The slow tier runs the same boundary through whole trials
(tests/test_cache_integrity.py)."""

import errno
import json
import logging
import math
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from taylor_tune import jsonio
from taylor_tune.jsonio import digest, entry_text, json_safe, open_own, read_entry, write_json, write_text

specials = st.sampled_from([math.inf, -math.inf, math.nan])  # drawn often: plain floats rarely give them
leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.text(max_size=5), specials,
    specials.map(np.float64), specials.map(np.float32),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(allow_nan=True, allow_infinity=True).map(np.float64),
    st.floats(width=32, allow_nan=True, allow_infinity=True).map(np.float32),
    st.integers(-1000, 1000).map(np.int64),
)
values = st.recursive(leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple),
    st.dictionaries(st.one_of(st.text(max_size=3), st.integers(0, 9)), inner, max_size=4),
), max_leaves=12)


def expected(value):
    """What a file must give back for `value`, written without json_safe: NaN as None, ±inf as the strings."""
    if isinstance(value, dict):
        return {str(k): expected(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [expected(v) for v in value]
    if isinstance(value, np.floating | float) and not isinstance(value, bool):
        x = float(value)
        return None if x != x else ("inf" if x == math.inf else "-inf" if x == -math.inf else x)
    if isinstance(value, np.integer):
        return int(value)
    return value


@settings(max_examples=60, deadline=None)
@given(values)
@example({"a": [math.inf, -math.inf, np.float32(math.inf)], 1: (math.nan, np.float64(-math.inf))})
def test_json_safe_writes_what_a_strict_encoder_accepts_and_reads_back_as_the_value(value):
    text = json.dumps(json_safe(value), allow_nan=False)  # raises on any NaN or inf left over
    assert json.loads(text) == expected(value)


def test_write_json_refuses_nothing_json_safe_handles_and_writes_one_value_per_line(tmp_path):
    data = {"a": [1.5, float("inf")], "b": {"c": np.float32(-np.inf), "d": float("nan")}, "e": np.arange(2)}
    text = write_json(tmp_path / "x.json", data).read_text()
    assert json.loads(text) == {"a": [1.5, "inf"], "b": {"c": "-inf", "d": None}, "e": [0, 1]}
    # committed results diff line by line: one value or bracket per line, nesting shown by a constant indent
    lines = text.splitlines()
    assert len(lines) == 14 and text.endswith("}\n")
    unit, depth = len(lines[1]) - len(lines[1].lstrip()), 0
    assert unit > 0
    for line in lines:
        depth -= line.strip().rstrip(",") in ("}", "]")
        assert line == " " * (unit * depth) + line.lstrip()
        depth += line.rstrip().endswith(("{", "["))
    assert depth == 0


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4), min_size=2, max_size=6))
def test_a_digest_does_not_depend_on_the_order_of_keys(fields):
    reordered = dict(reversed(list(fields.items())))
    assert list(reordered) != list(fields)
    assert digest(reordered) == digest(fields) == digest(dict(sorted(fields.items())))


def test_a_digest_takes_what_json_cannot_hold_as_its_text_and_tells_values_apart():
    assert digest({"path": Path("/a/b"), "dtype": np.dtype("float32")}) == digest({"path": "/a/b", "dtype": "float32"})
    assert len({digest({"n": 1}), digest({"n": 2}), digest({"m": 1}), digest({"n": "1"})}) == 4


def test_an_entry_reads_back_only_for_its_fields_and_part_and_payload():
    fields = {"model": "m", "n": 3}
    text = entry_text(fields, "rows", [[1, 2], {"k": "a\nb"}])
    assert read_entry(text, fields, "rows") == [[1, 2], {"k": "a\nb"}]
    for other_fields, other_part in (({"model": "m", "n": 4}, "rows"), (fields, "value")):
        with pytest.raises(ValueError, match="another one's"):
            read_entry(text, other_fields, other_part)
    header, payload = text.split("\n")
    with pytest.raises(ValueError, match="checksum"):
        read_entry(f"{header}\n{payload.replace('2', '3')}", fields, "rows")


@pytest.fixture
def no_umask():
    old = os.umask(0)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_files_of_a_shared_folder_are_not_executable_or_writable_by_others(tmp_path, no_umask):
    os.close(open_own(tmp_path / "a.lock", os.O_WRONLY))
    write_text(tmp_path / "b.json", "{}")
    for name in ("a.lock", "b.json"):
        assert mode(tmp_path / name) & 0o600 == 0o600 and mode(tmp_path / name) & 0o133 == 0, oct(mode(tmp_path / name))


@pytest.mark.parametrize("flags", [os.O_WRONLY | os.O_APPEND, os.O_WRONLY | os.O_TRUNC], ids=["append", "truncate"])
@pytest.mark.parametrize("link", ["symlink", "hard link"])
def test_open_own_replaces_a_link_found_at_its_name_and_leaves_its_target_alone(tmp_path, link, flags, caplog):
    outside, path = tmp_path / "OUTSIDE", tmp_path / "k.lock"
    outside.write_text("precious\n")
    path.symlink_to(outside) if link == "symlink" else os.link(outside, path)
    with caplog.at_level(logging.WARNING, logger=jsonio.__name__):
        with os.fdopen(open_own(path, flags), "w") as handle:
            handle.write("ours")
    assert outside.read_text() == "precious\n" and path.read_text() == "ours"
    assert not path.is_symlink() and path.stat().st_nlink == 1 and f"{path} is a link" in caplog.text


def test_open_own_truncates_a_file_of_its_own_when_asked(tmp_path):
    path = tmp_path / "k.lock"
    path.write_text("an old, longer content")
    with os.fdopen(open_own(path, os.O_WRONLY | os.O_TRUNC), "w") as handle:
        handle.write("new")
    assert path.read_text() == "new"
    with os.fdopen(open_own(path, os.O_WRONLY | os.O_APPEND), "a") as handle:
        handle.write("+")
    assert path.read_text() == "new+"
    os.close(open_own(path, os.O_WRONLY | os.O_TRUNC))  # truncated to nothing, with nothing written
    assert path.read_bytes() == b""


def test_open_own_refuses_a_link_planted_again_after_every_removal(tmp_path, monkeypatch):
    outside, path = tmp_path / "OUTSIDE", tmp_path / "k.lock"
    outside.write_text("precious\n")
    path.symlink_to(outside)
    unlink = Path.unlink

    def replant(self, missing_ok=False):
        unlink(self, missing_ok=missing_ok)
        if self == path:
            self.symlink_to(outside)

    monkeypatch.setattr(Path, "unlink", replant)
    with pytest.raises(OSError, match="again and again") as refused:
        open_own(path, os.O_WRONLY | os.O_TRUNC)
    assert refused.value.errno == errno.ELOOP  # the error a symlink at an O_NOFOLLOW open gives: a caller can tell
    assert outside.read_text() == "precious\n"


def test_write_text_refuses_a_link_planted_under_its_temporary_name_after_removing_the_old_one(tmp_path, monkeypatch):
    """The race `write_text` closes: something plants a link at the temporary name between its unlink and its open."""
    outside, path = tmp_path / "OUTSIDE", tmp_path / "x.json"
    outside.write_text("precious\n")
    unlink = Path.unlink

    def plant_after(self, missing_ok=False):
        unlink(self, missing_ok=missing_ok)
        if self.name.endswith(".tmp") and not getattr(plant_after, "done", False):
            plant_after.done = True
            self.symlink_to(outside)

    monkeypatch.setattr(Path, "unlink", plant_after)
    with pytest.raises(OSError):
        write_text(path, "new")
    assert outside.read_text() == "precious\n" and not path.exists()


def test_open_own_goes_on_when_another_process_removed_the_link_first(tmp_path, caplog):
    """Two processes find the same link at a lock's name: the other one removes it between this one's warning and
    its own removal. The removal finds nothing and this one creates its file."""
    outside, path = tmp_path / "OUTSIDE", tmp_path / "k.lock"
    outside.write_text("precious\n")
    path.symlink_to(outside)

    class OtherProcess(logging.Handler):
        def emit(self, record):
            path.unlink(missing_ok=True)

    handler = OtherProcess(logging.WARNING)
    jsonio.log.addHandler(handler)
    try:
        os.close(open_own(path, os.O_WRONLY))
    finally:
        jsonio.log.removeHandler(handler)
    assert path.is_file() and not path.is_symlink() and outside.read_text() == "precious\n"


def test_write_text_that_cannot_create_its_temporary_file_raises_that_error(tmp_path, monkeypatch):
    """A write that fails before its temporary file exists (a full disk) raises the error it failed with, not the
    cleanup's, and leaves the previous file as it was."""
    path = write_text(tmp_path / "x.json", "old")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jsonio.os, "open", full)
    with pytest.raises(OSError) as raised:
        write_text(path, "new")
    monkeypatch.undo()
    assert raised.value.errno == errno.ENOSPC and path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


@pytest.mark.parametrize("planted", ["name", "temporary name", "both"])
def test_write_whole_replaces_a_link_planted_at_its_names_and_never_writes_through_it(tmp_path, planted):
    """Issue 80: every file the project writes into a sweep's folder (the race's state, each trial's outcomes and
    finished artifacts in storage) is written as a file of its own: a symlink planted at its name, or at the name of
    its temporary file, is replaced, and what it points at is left as it was."""
    import os

    from pyarrow import fs

    from taylor_tune.jsonio import write_whole

    outside = tmp_path / "outside.txt"
    outside.write_text("someone else's")
    folder = tmp_path / "sweep"
    folder.mkdir()
    path = folder / "outcomes.parquet"
    names = {"name": [path.name], "temporary name": [f".{path.name}.{os.getpid()}.tmp"]}
    for name in names.get(planted, [path.name, f".{path.name}.{os.getpid()}.tmp"]):
        (folder / name).symlink_to(outside)
    write_whole(fs.LocalFileSystem(), str(path), b"ours")
    assert outside.read_text() == "someone else's"
    assert not path.is_symlink() and path.read_bytes() == b"ours"
    assert sorted(p.name for p in folder.iterdir()) == [path.name]
