"""The one place where numbers become JSON. In memory a ratio may be inf and a missing value NaN (floats stay
floats, so Tune and pandas compare them); JSON has neither, so a file gets "inf" / "-inf" and null. Also the
digests that name cache entries, the header and checksum of a JSON cache entry, and opening the files of a shared
folder without following a link planted there."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import stat
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


def json_safe(value):
    """Dicts, lists and tuples recursively; numpy scalars and arrays as Python; ±inf as "inf"/"-inf"; NaN as None."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [json_safe(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
    return value


def open_own(path: Path, flags: int) -> int:
    """`os.open(path, flags | O_CREAT)` of a file of ours in a shared folder, never through a link: a symlink or a
    hard-linked file found at `path` (something else's file, which a write or a truncation would change) is removed
    (the link only; what it points at is untouched), logged, and a file of our own is created in its place.
    `O_TRUNC` in `flags` truncates only once the file is known to be ours."""
    for _ in range(3):
        try:
            # opening with O_TRUNC would empty a hard-linked file before fstat could tell it is not ours
            fd = os.open(path, flags & ~os.O_TRUNC | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as error:
            if error.errno != errno.ELOOP:  # O_NOFOLLOW's answer for a symlink
                raise
        else:
            info = os.fstat(fd)
            if info.st_nlink <= 1:
                if flags & os.O_TRUNC:
                    os.ftruncate(fd, 0)
                return fd
            os.close(fd)
        log.warning("%s is a link to another file, not a file of ours: the link is removed", path)
        path.unlink(missing_ok=True)
    raise OSError(errno.ELOOP, f"{path} is replaced by a link again and again; refused")


def linked_part(root: str | Path, path: str | Path) -> Path | None:
    """The first folder below `root` on the way to `path` (its parent included) that is a symbolic link, or None:
    a file of a sweep reached through such a folder lies wherever the link points, outside the sweep. `root` itself
    may be a link (where the user keeps the sweep is the user's choice)."""
    root, path = Path(root), Path(path)
    try:
        parts = path.parent.relative_to(root).parts
    except ValueError:
        return None
    folder = root
    for part in parts:
        folder = folder / part
        if folder.is_symlink():
            return folder
    return None


def read_own(path: str | Path) -> bytes | None:
    """The bytes of a regular file of ours, never through a link: None where `path` is missing or unreadable, a
    symbolic link, not a regular file, or a file with other hard links (its content is another file's too, and what
    is read from a sweep is copied into reports)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            return None
        try:
            return handle.read()
        except OSError:
            return None


def write_text(path: str | Path, text: str) -> Path:
    """Written whole or not at all (`write_bytes`), as UTF-8."""
    return write_bytes(path, text.encode("utf-8"))


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Written whole or not at all (a temporary file renamed into place): a reader never sees half a file, and a
    write that fails (a full disk) leaves the previous file as it was and no temporary file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # a leftover, or a link planted under the name
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_whole(filesystem, path: str, data: bytes, root: str | None = None) -> None:
    """`data` at `path` of a pyarrow filesystem, whole or not at all and never through a link: on a local disk
    `write_bytes` (a file of our own renamed into place: a link planted at the name or at a temporary name is
    replaced, not written through), on object storage one PUT, which is whole by itself. With `root` (the sweep's
    folder), a folder below it on the way that is a symbolic link is refused (OSError), not written through."""
    from pyarrow import fs

    if isinstance(filesystem, fs.LocalFileSystem):
        linked = None if root is None else linked_part(root, path)
        if linked is not None:
            raise OSError(errno.ELOOP, f"{linked} is a symbolic link, and {path} would be written through it, "
                                       "outside the sweep; refused")
        write_bytes(path, data)
        return
    with filesystem.open_output_stream(path) as stream:
        stream.write(data)


def write_json(path: str | Path, data) -> Path:
    """`data` as indented JSON (json_safe), written whole or not at all."""
    return write_text(path, json.dumps(json_safe(data), indent=2, allow_nan=False) + "\n")


def digest(value) -> str:
    """sha256 of `value` as canonical JSON (keys sorted; anything JSON cannot hold as its str)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def checked_bytes(fields: dict, part: str, payload: bytes, **about) -> bytes:
    """A cache entry: one JSON header line ({"fields", "part", what else is `about` it, "sha256"}: what it is and the
    sha256 of its payload), then the payload's bytes."""
    header = {"fields": fields, "part": part, **about, "sha256": hashlib.sha256(payload).hexdigest()}
    return json.dumps(header, separators=(",", ":")).encode() + b"\n" + payload


def checked_payload(data: bytes, fields: dict, part: str) -> tuple[dict, bytes]:
    """(header, payload) of an entry written by `checked_bytes` for these `fields`; ValueError when the entry is
    another one's, or its payload is not what its checksum says (cut short, edited)."""
    line, _, payload = data.partition(b"\n")
    header = json.loads(line)
    if not isinstance(header, dict) or header.get("fields") != fields or header.get("part") != part:
        raise ValueError("the entry is another one's (its fields differ)")
    if header.get("sha256") != hashlib.sha256(payload).hexdigest():
        raise ValueError("its payload does not match its checksum (cut short or changed)")
    return header, payload


def entry_text(fields: dict, part: str, value) -> str:
    """A JSON cache entry (`checked_bytes`): the payload `value` as JSON."""
    return checked_bytes(fields, part, json.dumps(value, separators=(",", ":"), allow_nan=False).encode()).decode()


def read_entry(text: str, fields: dict, part: str):
    """The value of an entry written by `entry_text` for these `fields` (`checked_payload`'s ValueError)."""
    return json.loads(checked_payload(text.encode(), fields, part)[1])
