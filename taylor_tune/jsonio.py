"""The one place where numbers become JSON. In memory a ratio may be inf and a missing value NaN (floats stay
floats, so Tune and pandas compare them); JSON has neither, so a file gets "inf" / "-inf" and null."""

from __future__ import annotations

import json
import math
import os
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
