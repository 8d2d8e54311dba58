"""Progress bars of taylor_tune's own long stages, shown only where someone watches: when stderr is a terminal.

In CI, pipes, Ray workers and notebooks' captured output nothing is drawn. Libraries' own bars (transformers,
datasets, lm-eval) are switched off by the CLI unless `--verbose`; these bars are ours and ignore that switch.
`TAYLOR_TUNE_PROGRESS=0` turns them off, `=1` forces them on.
"""

from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm


def shown() -> bool:
    forced = os.environ.get("TAYLOR_TUNE_PROGRESS")
    if forced in ("0", "1"):
        return forced == "1"
    return sys.stderr.isatty()


def bar(total: int, desc: str, unit: str = "it", **kwargs) -> tqdm:
    """A tqdm bar on stderr, drawn only if `shown()` (a disabled tqdm still counts and costs nothing)."""
    return tqdm(total=total, desc=desc, unit=unit, disable=not shown(), file=sys.stderr, dynamic_ncols=True,
                leave=False, **kwargs)
