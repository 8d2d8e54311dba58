"""One driver per experiment folder: a lock file naming the holder's PID and host, taken before Ray starts. And one
timed speed measurement at a time on a node (`timing_lock`).

Two drivers on one folder would both run the sweep's trials and overwrite each other's state. The lock is created
with O_EXCL; one whose holder has died on this host is taken over, and one held on another host is refused with
the holder named (shared storage: only that host can tell whether it is alive). Local folders only: on `s3://`
storage the lock is the user's to keep (one `ray job submit` per experiment).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from taylor_tune.errors import ConfigError
from taylor_tune.jsonio import open_own

LOCK = ".taylor_tune_driver.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


@contextmanager
def driver_lock(folder: str) -> Iterator[None]:
    """Hold the experiment folder's driver lock for the duration; ConfigError if a live driver holds it."""
    if "://" in folder:
        yield
        return
    path = Path(folder) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
                pid, host = int(holder["pid"]), str(holder["host"])
            except (OSError, ValueError, KeyError, TypeError):  # half written or damaged: treated as stale
                path.unlink(missing_ok=True)
                continue
            if host != me["host"]:
                raise ConfigError(f"{folder}: another driver (pid {pid} on {host}) holds {LOCK}; if it has stopped, "
                                  f"remove {path} and run again") from None
            if _alive(pid):
                raise ConfigError(f"{folder}: another driver (pid {pid} on this host) is running this sweep; "
                                  "wait for it, or stop it first") from None
            path.unlink(missing_ok=True)  # its holder died without releasing it
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(me))
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def timing_lock_path() -> Path:
    """The node's speed-timing lock: one per user in the temporary folder (every sweep of that user on the node)."""
    return Path(tempfile.gettempdir()) / f"taylor_tune_speed_{os.getuid()}.lock"


@contextmanager
def timing_lock(path: Path | None = None) -> Iterator[float]:
    """Held while a trial times a model, so that no two trials on the node time at the same moment (their other
    stages still overlap); yields the seconds spent waiting. A file lock (flock): released when the holder's file
    closes, also when its process dies."""
    start = time.perf_counter()
    with os.fdopen(open_own(path or timing_lock_path(), os.O_WRONLY), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield time.perf_counter() - start
