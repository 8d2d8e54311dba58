"""From a sweep to a model one serves: `export` chooses a trial (choose), builds its model again from its recorded
configuration and checks it against the trial's numbers (rebuild), and writes the folder with its model card (card,
write). `choose` and `card` import neither torch nor ray; `export` loads torch only when called.

    from taylor_tune.export import export
    export("runs/sweeps/real_demo", "runs/export/real_demo")               # the report's best configuration
    export("runs/sweeps/real_demo", "runs/export/second", rank=2)
"""

from __future__ import annotations

from pathlib import Path


def export(sweep: str, output: str | Path, **choice) -> Path:
    """The chosen trial's model (`choose.choose`'s keywords: model, trial, rank, constraints) rebuilt, checked and
    written to `output` with its model card; ExportError (one line) when there is nothing to write."""
    from taylor_tune.export.write import export as run  # torch, only when a model is built

    return run(sweep, output, **choice)


__all__ = ["export"]
