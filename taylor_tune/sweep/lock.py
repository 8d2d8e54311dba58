"""One timed speed measurement at a time on a node (`timing_lock`): two trials timing at once would each measure
the other's load."""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from taylor_tune.jsonio import open_own


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
