"""A trial's reports kept across a driver's death. Tune writes each report to `result.json` in the driver's own
staging folder, opened for appending when the trial starts, and syncs it to the trial's folder in storage. A trial
that Tune runs again after a restore, with no checkpoint recorded (the driver was killed between the trial's final
report and its next saved state), starts from an empty local file, so the storage copy came back holding only the
rerun's report: the earlier per-stage reports were lost (the final numbers were right, `trainable` reuses them).
Tune restores the file itself only for a trial with a checkpoint; this does the same for one without."""

from __future__ import annotations

from pathlib import Path

from ray.air.constants import EXPR_RESULT_FILE
from ray.tune import Callback

from taylor_tune.storage.folder import restore


class KeptReports(Callback):
    """Before Tune's JSON logger opens a restarted trial's local `result.json` (callbacks run in order, Tune's own
    loggers after the sweep's), the storage copy is brought back where the local one is missing."""

    def on_trial_start(self, iteration: int, trials: list, trial, **info) -> None:
        local = Path(trial.local_path, EXPR_RESULT_FILE)
        if trial.checkpoint or local.exists():  # Tune restores it itself, or this driver has it already
            return
        restore(trial.storage.storage_filesystem, f"{trial.storage.trial_fs_path}/{EXPR_RESULT_FILE}", local)
