"""The one place where numbers become JSON. In memory a ratio may be inf and a missing value NaN (floats stay
floats, so Tune and pandas compare them); JSON has neither, so a file gets "inf" / "-inf" and null. Also the
digests that name cache entries, and the JSON entry that processes sharing a folder build once."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np


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


def write_text(path: str | Path, text: str) -> Path:
    """Written whole or not at all (a temporary file renamed into place): a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def write_json(path: str | Path, data) -> Path:
    """`data` as indented JSON (json_safe), written whole or not at all."""
    return write_text(path, json.dumps(json_safe(data), indent=2, allow_nan=False) + "\n")


def digest(value) -> str:
    """sha256 of `value` as canonical JSON (keys sorted; anything JSON cannot hold as its str)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def built_once(path: Path, fields: dict, build: Callable[[], object], read: Callable[[object], object],
               part: str = "value") -> tuple[object, bool]:
    """(read(stored), built): the JSON `path` holds under `part`, written with `fields`; when there is none, or its
    fields differ, or `read` cannot take it (a damaged entry), `build()`'s value, stored first. The first of the
    processes sharing the folder builds under a file lock (released when the file closes, also when the process
    dies); the others wait for it, then read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = json.loads(json.dumps(fields))  # as it reads back
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entry = json.loads(path.read_text())
            if entry["fields"] != fields:
                raise ValueError("another entry's fields")
            return read(entry[part]), False
        except FileNotFoundError:
            pass
        except Exception as error:  # anything a damaged entry makes the reader raise: built again
            logging.getLogger(__name__).warning("%s does not read back (%s: %s); building it again", path.name,
                                                type(error).__name__, error)
        value = build()
        write_text(path, json.dumps({"fields": fields, part: value}, separators=(",", ":")))
        return read(value), True
