"""One driver per experiment folder: a lock file naming the holder's PID and host, taken before Ray starts.

Two drivers on one folder would both run the sweep's trials and overwrite each other's state. The lock is created
with O_EXCL; one whose holder has died on this host is taken over, and one held on another host is refused with
the holder named (shared storage: only that host can tell whether it is alive). On object storage (`s3://`), where
no file can be created exclusively, a renewed lease object stands for the lock (`storage_lease`).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from taylor_tune.errors import StorageError
from taylor_tune.storage.location import local_folder, open_location

LOCK = ".taylor_tune_driver.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


# On object storage the driver holds a lease object in the experiment (`LEASE`), renewed every LEASE_S / 3 seconds;
# one not renewed for LEASE_S is a stopped driver's and is taken over
LEASE = "taylor_tune/driver.json"
LEASE_S = 60.0
LEASE_SETTLE_S = 1.0  # between writing the lease and reading it back: a rival's write in between wins


def _lease(filesystem, path: str) -> dict | None:
    try:
        with filesystem.open_input_stream(path) as stream:
            held = json.loads(stream.read())
        return held if isinstance(held, dict) else None
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return None
    except OSError as error:
        if "NotFound" in type(error).__name__ or "NOT_FOUND" in str(error) or "NoSuchKey" in str(error):
            return None
        raise


def _write_lease(filesystem, path: str, lease: dict) -> None:
    with filesystem.open_output_stream(path) as stream:
        stream.write(json.dumps(lease).encode())


def _refuse_if_held(folder: str, held: dict | None, me: dict) -> None:
    """StorageError when `held` is another driver's live lease: renewed within LEASE_S, and not a dead process of
    this host."""
    if not held or held.get("token") == me["token"]:
        return
    try:
        age, pid, host = time.time() - float(held["renewed"]), int(held["pid"]), str(held["host"])
    except (KeyError, TypeError, ValueError):
        return  # damaged: taken over
    if age > LEASE_S or (host == me["host"] and not _alive(pid)):
        return
    raise StorageError(f"{folder}: another driver (pid {pid} on {host}) holds this sweep's lease in storage (renewed "
                      f"{max(age, 0):.0f} s ago); wait for it, or stop it first (a stopped driver's lease lapses "
                      f"{LEASE_S:.0f} s after its last renewal)")


@contextmanager
def storage_lease(folder: str) -> Iterator[None]:
    """One driver per experiment on object storage, where no lock file can be created exclusively: a lease object
    (`LEASE`) naming the holder, written, read back after LEASE_SETTLE_S (the last of two rival writes is the one
    both read back: the other refuses), renewed by a thread while the sweep runs and removed at its end."""
    import threading
    import uuid

    filesystem, root = open_location(folder)
    path = f"{root.rstrip('/')}/{LEASE}"
    me = {"pid": os.getpid(), "host": socket.gethostname(), "token": uuid.uuid4().hex}
    _refuse_if_held(folder, _lease(filesystem, path), me)
    _write_lease(filesystem, path, me | {"renewed": time.time()})
    time.sleep(LEASE_SETTLE_S)
    _refuse_if_held(folder, _lease(filesystem, path), me)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(LEASE_S / 3):
            try:
                _write_lease(filesystem, path, me | {"renewed": time.time()})
            except OSError:  # a blip of the storage: the next renewal tries again, well within the lease
                pass

    thread = threading.Thread(target=renew, name="taylor-tune-lease", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
        try:
            if (_lease(filesystem, path) or {}).get("token") == me["token"]:
                filesystem.delete_file(path)
        except OSError:
            pass  # it lapses by itself


@contextmanager
def driver_lock(folder: str) -> Iterator[None]:
    """Hold the experiment folder's driver lock for the duration; StorageError if a live driver holds it. On object
    storage (a URI) the lock is a lease object in the experiment (`storage_lease`)."""
    local = local_folder(folder)
    if local is None:
        with storage_lease(folder):
            yield
        return
    path = local / LOCK
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
                raise StorageError(f"{folder}: another driver (pid {pid} on {host}) holds {LOCK}; if it has stopped, "
                                  f"remove {path} and run again") from None
            if _alive(pid):
                raise StorageError(f"{folder}: another driver (pid {pid} on this host) is running this sweep; "
                                  "wait for it, or stop it first") from None
            path.unlink(missing_ok=True)  # its holder died without releasing it
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(me))
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
