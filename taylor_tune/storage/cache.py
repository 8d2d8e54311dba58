"""A sweep's shared entries (importance passes, built requests, paired speed), in the sweep's own storage: a local or
shared folder, or object storage (`s3://`, `gs://`), all through one `pyarrow.fs` filesystem and one code path.

An entry is built once across every process and node of the sweep. Who builds it is decided by a lease (`Leases`):
in a Ray sweep a named actor grants them (`sweep.tune.leases`), so coordination never rests on file locks, which some
network filesystems fake; without Ray, on a local folder, `FileLeases` (a lock file with a heartbeat). The holder
renews its lease while it builds; a holder that dies lets the lease lapse (or, under Ray, loses it with its node) and
a waiting trial takes over. Entries are written whole (one PUT, or a temporary file renamed into place) with the
sha256 of their bytes beside them (`<name>.sha256`); on object storage a node keeps a read-through copy of each entry
it read, named by that checksum, so a large entry crosses the network once per node. Transient storage errors
(timeouts, 5xx, throttling) are retried with backoff and counted (`StoreStats`). Every hit, build, takeover and
damaged entry is one small event object under `events/`: the caches' own counters, readable on any storage.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from pyarrow import fs

from taylor_tune.jsonio import digest, entry_text, read_entry, write_bytes, write_whole
from taylor_tune.storage.location import open_location

log = logging.getLogger(__name__)
T = TypeVar("T")

# what a storage error says when trying again may help: a timeout, a 5xx, throttling, a dropped connection
TRANSIENT = ("timeout", "timed out", "status code 500", "status code 502", "status code 503", "status code 504",
             "slowdown", "slow down", "throttl", "toomanyrequests", "connection reset", "connection refused",
             "temporarily", "internalerror", "serviceunavailable", "requesttimeout", "could not connect")
_EVENTS = itertools.count()


def is_transient(error: BaseException) -> bool:
    return isinstance(error, (TimeoutError, ConnectionError)) or (
        isinstance(error, OSError) and not isinstance(error, FileNotFoundError)
        and any(word in str(error).lower() for word in TRANSIENT))


def retried(operation: Callable[[], T], stats: StoreStats, where: str, *, retries: int = 5,
            backoff_s: float = 0.2) -> T:
    """`operation()`, tried again up to `retries` times after a transient storage error (`is_transient`), waiting
    `backoff_s` and doubling; each retry counted in `stats`. Any other error, or the last, is raised."""
    for attempt in range(retries + 1):
        try:
            return operation()
        except OSError as error:
            if attempt == retries or not is_transient(error):
                raise
            stats.storage_retries += 1
            delay = backoff_s * 2 ** attempt
            log.warning("storage %s: %s; trying again in %.1f s", where, str(error)[:200], delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


@dataclass
class StoreStats:
    """What one trial's stores did: bytes moved, storage retries, lease round trips and seconds waited."""

    bytes_read: int = 0
    bytes_written: int = 0
    copy_hits: int = 0  # entries read from this node's copy instead of storage
    storage_retries: int = 0
    lease_calls: int = 0
    lease_wait_s: float = 0.0

    def metrics(self) -> dict:
        return {f"store_{name}": value for name, value in asdict(self).items()}


class Leases(Protocol):
    """Who builds an entry (`name`: the entry's path in the storage). `acquire(name)` answers "granted" (build
    it), "takeover" (build it: its last holder died), "stored" (a holder stored it: read it) or "wait" (held by a
    live holder: ask again), and may wait a while for news before answering. `renew` while building; `release`
    after, saying whether the entry is stored."""

    def acquire(self, name: str, *, again: bool = False) -> str: ...

    def renew(self, name: str) -> None: ...

    def release(self, name: str, *, stored: bool) -> None: ...


class FileLeases:
    """Leases as lock files beside the entries of a local folder (no Ray): `<key>.lock` created with O_EXCL,
    refreshed by the holder (a heartbeat), taken over when not refreshed for `stale_s` (its holder was killed)."""

    def __init__(self, *, poll_s: float = 0.2, stale_s: float = 60.0):
        self.poll_s, self.stale_s = poll_s, stale_s

    @staticmethod
    def _lock(name: str) -> Path:
        path = Path(name)
        return path.with_name(f"{path.name.split('.', 1)[0]}.lock")

    def acquire(self, name: str, *, again: bool = False) -> str:
        lock = self._lock(name)
        lock.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW)
        except FileExistsError:
            if lock.is_symlink():  # a link planted at the name is no holder's: removed (the link only)
                log.warning("%s is a link, not a lock of ours: the link is removed", lock)
                lock.unlink(missing_ok=True)
                return "wait"
            try:
                stale = time.time() - lock.lstat().st_mtime > self.stale_s
            except FileNotFoundError:
                return "wait"
            if stale:
                lock.unlink(missing_ok=True)
                return self._take(lock)
            time.sleep(self.poll_s)
            return "wait"
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        return "granted"

    def _take(self, lock: Path) -> str:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW)
        except FileExistsError:
            return "wait"
        os.close(fd)
        return "takeover"

    def renew(self, name: str) -> None:
        try:
            os.utime(self._lock(name), follow_symlinks=False)
        except FileNotFoundError:
            pass

    def release(self, name: str, *, stored: bool) -> None:
        self._lock(name).unlink(missing_ok=True)


class Store:
    """Entries under one folder of the sweep's storage (see the module's docstring)."""

    def __init__(self, location: str | Path, *, leases: Leases | None = None, copies: str | Path | None = None,
                 stats: StoreStats | None = None, heartbeat_s: float = 5.0, retries: int = 5,
                 backoff_s: float = 0.2, filesystem: fs.FileSystem | None = None):
        """`location`: a folder or a URI; with `filesystem`, a path in it."""
        self.filesystem, self.base = open_location(location, filesystem)
        self.local = isinstance(self.filesystem, fs.LocalFileSystem)
        self.location = str(location)
        # without a lease service a local folder coordinates by lock files; object storage needs Ray's leases
        self.leases = leases if leases is not None else (FileLeases() if self.local else None)
        self.copies = None if self.local or copies is None else Path(copies)
        self.stats = stats if stats is not None else StoreStats()
        self.heartbeat_s, self.retries, self.backoff_s = heartbeat_s, retries, backoff_s
        self.node = getattr(self.leases, "holder", {}).get("node")  # the Ray node, under Ray's leases

    def path(self, name: str) -> str:
        return f"{self.base}/{name}"

    def _retry(self, operation: Callable[[], T]) -> T:
        return retried(operation, self.stats, self.location, retries=self.retries, backoff_s=self.backoff_s)

    def read(self, name: str) -> bytes | None:
        """The bytes of the entry `name`, or None when there is none (a local link is not followed)."""

        def read() -> bytes | None:
            if self.local:
                try:
                    with os.fdopen(os.open(self.path(name), os.O_RDONLY | os.O_NOFOLLOW), "rb") as handle:
                        return handle.read()
                except FileNotFoundError:
                    return None
                except OSError as error:
                    if error.errno == errno.ELOOP:
                        return None  # a link planted at the name: no entry of ours
                    raise
            try:
                with self.filesystem.open_input_stream(self.path(name)) as stream:
                    return stream.read()
            except FileNotFoundError:
                return None

        data = self._retry(read)
        if data is not None:
            self.stats.bytes_read += len(data)
        return data

    def write(self, name: str, data: bytes) -> None:
        """`data` at `name`, whole or not at all."""

        def write() -> None:
            if self.local:
                write_bytes(self.path(name), data)
            else:
                write_whole(self.filesystem, self.path(name), data)

        self._retry(write)
        self.stats.bytes_written += len(data)

    def remove(self, name: str) -> None:
        def remove() -> None:
            try:
                self.filesystem.delete_file(self.path(name))
            except FileNotFoundError:
                pass

        self._retry(remove)

    def names(self, folder: str = "") -> list[str]:
        """The names of the files directly under `folder`."""
        selector = fs.FileSelector(self.path(folder).rstrip("/"), allow_not_found=True)
        infos = self._retry(lambda: self.filesystem.get_file_info(selector))
        return sorted(info.base_name for info in infos if info.type == fs.FileType.File)

    def record(self, event: str, key: str, **extra) -> None:
        """One event of this cache, as an object of its own (object storage cannot append)."""
        key = key.split(".", 1)[0]
        stamp = f"{time.time_ns()}-{socket.gethostname()}-{os.getpid()}-{next(_EVENTS)}"
        line = {"event": event, "key": key, "time": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
                **({"node": self.node} if self.node else {}), **extra}
        self.write(f"events/{stamp}.json", json.dumps(line).encode())

    def events(self) -> list[dict]:
        """Every event recorded, oldest first (and those of an older sweep's `events.jsonl`, when there is one)."""
        events = []
        legacy = self.read("events.jsonl")
        if legacy is not None:
            events += [json.loads(line) for line in legacy.decode().splitlines() if line.strip()]
        for name in self.names("events"):
            data = self.read(f"events/{name}")
            if data is not None:
                events.append(json.loads(data))
        return sorted(events, key=lambda event: event.get("time", 0.0))  # stable: an old log without times first

    def _fetch(self, name: str) -> bytes | None:
        """The entry's bytes; on object storage through this node's copy when its checksum names one."""
        if self.copies is None:
            return self.read(name)
        sha = self.read(f"{name}.sha256")
        copy = None if sha is None else self.copies / sha.decode().strip()
        if copy is not None and copy.is_file():
            data = copy.read_bytes()
            if hashlib.sha256(data).hexdigest() == copy.name:
                self.stats.copy_hits += 1
                return data
        data = self.read(name)
        if data is not None and copy is not None and hashlib.sha256(data).hexdigest() == copy.name:
            write_bytes(copy, data)
        return data

    def built_once(self, name: str, build: Callable[[], bytes], use: Callable[[bytes], T],
                   details: dict | None = None, made: Callable[[bytes], T] | None = None) -> tuple[T, str]:
        """(use(entry), event): the entry `name`, built by `build()` and stored when there is none, by one holder
        of its lease across all processes and nodes. `use` takes the bytes and raises on what it cannot use: an
        entry it refuses (cut short, changed, another's) is logged, removed and built again, once. The event:
        "hit" or "computed"; a build after the last holder died records a "takeover" event first. Events name the
        entry by its key (`name` without its suffix); `details` go into the "computed" one. `made`: how the bytes
        just built are taken (default `use`)."""
        damaged, again = False, False
        while True:
            data = self._fetch(name)
            if data is not None:
                try:
                    value = use(data)
                except Exception as error:  # anything a damaged entry makes the reader raise
                    if damaged:
                        raise
                    damaged = again = True
                    log.warning("cache entry %s is refused (%s: %s); removed, building it again", self.path(name),
                                type(error).__name__, str(error)[:200])
                    self.record("damaged", name, error=f"{type(error).__name__}: {str(error)[:200]}")
                    self.remove(name)
                    self.remove(f"{name}.sha256")
                    continue
                self.record("hit", name)
                return value, "hit"
            answer = self._acquire(name, again)
            if answer == "stored":
                again = True  # stored, and yet not here: the next ask builds it
                continue
            if answer == "wait":
                continue
            return self._build(name, answer, build, use, details or {}, made or use)

    def _acquire(self, name: str, again: bool) -> str:
        if self.leases is None:
            return "granted"
        start = time.perf_counter()
        try:
            return self.leases.acquire(self.path(name), again=again)
        finally:
            self.stats.lease_calls += 1
            self.stats.lease_wait_s += time.perf_counter() - start

    def _build(self, name: str, granted: str, build: Callable[[], bytes], use: Callable[[bytes], T],
               details: dict, made: Callable[[bytes], T]):
        stored, stop = False, threading.Event()

        def heartbeat() -> None:
            while not stop.wait(self.heartbeat_s):
                try:
                    self.leases.renew(self.path(name))
                    self.stats.lease_calls += 1
                except Exception as error:  # a missed renewal only risks a takeover, never a wrong entry
                    log.warning("renewing the lease of %s: %s", name, error)

        beat = threading.Thread(target=heartbeat, daemon=True)
        if self.leases is not None:
            beat.start()
        try:
            data = self._fetch(name)  # stored between the look and the lease: read it
            if data is not None:
                value = use(data)
                stored = True
                self.record("hit", name)
                return value, "hit"
            if granted == "takeover":
                self.record("takeover", name)
            start = time.perf_counter()
            data = build()
            value = made(data)
            self.write(name, data)
            self.write(f"{name}.sha256", hashlib.sha256(data).hexdigest().encode())
            stored = True
            self.record("computed", name, seconds=time.perf_counter() - start, **details)
            return value, "computed"
        finally:
            stop.set()
            if self.leases is not None:
                self._release(name, stored)

    def _release(self, name: str, stored: bool) -> None:
        start = time.perf_counter()
        try:
            self.leases.release(self.path(name), stored=stored)
        finally:
            self.stats.lease_calls += 1
            self.stats.lease_wait_s += time.perf_counter() - start


def counters(events: list[dict]) -> dict[str, int]:
    """Counts of a cache's events: passes computed, hits, takeovers."""
    return {"computed": sum(e["event"] == "computed" for e in events),
            "hits": sum(e["event"] == "hit" for e in events),
            "takeovers": sum(e["event"] == "takeover" for e in events)}


def json_name(fields: dict) -> str:
    """The name of the JSON entry for `fields` (`built_json`)."""
    return f"{digest(json.loads(json.dumps(fields)))[:24]}.json"


def built_json(store: Store, fields: dict, build: Callable[[], object], read: Callable[[object], object],
               part: str = "value") -> tuple[object, bool]:
    """(read(payload), built): the JSON entry of `store` for `fields` (`jsonio.entry_text`: a header with its fields
    and checksum, then the payload), taken by `read`, which raises on anything it cannot use; on a miss, or an entry
    that is another's, not what its checksum says or refused by `read`, `build()`'s payload, stored first."""
    fields = json.loads(json.dumps(fields))  # as it reads back
    value, event = store.built_once(
        json_name(fields), lambda: entry_text(fields, part, build()).encode(),
        lambda data: read(read_entry(data.decode(), fields, part)))
    return value, event == "computed"
