"""A trial's model built again from its recorded configuration (its folder's config.json): the trial's own stages
(pruning's, then recovery's when the trial recovered), with its seeds, dtype and device, then its perplexity, and
checked against what the trial reported before anything is written.

The importance is computed afresh, not read from the sweep's cache: a rebuild that went through the cache would not
notice a calibration text that changed since. On the same device type the rebuild is the trial's computation again:
on a CPU in float32 it gives the trial's numbers to the last bit (tests/export), so the tolerances below only leave
room for another thread count's order of summation; a plan that differs by one group moves the perplexity by far more
(docs/export.md says what was measured)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError

from taylor_tune.export.choose import Chosen, ExportError
from taylor_tune.storage.folder import trial_file
from taylor_tune.sweep.folder import flat
from taylor_tune.sweep.stages import evaluation, recovery
from taylor_tune.sweep.stages.pruning import pruning_stages
from taylor_tune.sweep.stages.run import Stage, TrialConfig, TrialRun

PPL_TOLERANCE = 1e-4  # relative: the rebuilt model's held-out perplexity against the trial's
LOSS_TOLERANCE = 1e-6  # relative: a recovered model's held-out loss after recovery against the trial's


@dataclass
class Rebuilt:
    """The trial's model as rebuilt (pruned, and recovered with its adapters merged), with what was checked."""

    trial: TrialConfig
    run: TrialRun
    checks: dict  # name -> (reported, rebuilt)

    @property
    def model(self):
        return self.run.pruning.model

    @property
    def tokenizer(self):
        return self.run.pruning.tokenizer


def _read(folder: str | Path, name: str, parse, unreadable: str, invalid: str) -> TrialConfig:
    """A trial's record `name` read (`trial_file`) and parsed; ExportError naming the file when it cannot be."""
    path = f"{str(folder).rstrip('/')}/{name}"
    try:
        path, text = trial_file(folder, name)
        return parse(json.loads(text))
    except OSError as error:
        raise ExportError(f"{path}: cannot read {unreadable} ({error.strerror or error})") from None
    except (ValueError, KeyError, TypeError) as error:  # JSON, pydantic, a missing or mistyped key alike
        first = error.errors()[0] if isinstance(error, ValidationError) else None
        said = (f"{'.'.join(map(str, first['loc']))}: {first['msg']}" if first
                else str(error).splitlines()[0] if str(error) else type(error).__name__)
        raise ExportError(f"{path}: not {invalid} ({said})") from None


def trial_config(folder: str | Path) -> TrialConfig:
    """The trial's recorded configuration (config.json: JSON, validated field by field; nothing else is read)."""
    return _read(folder, "config.json", TrialConfig.from_record, "the trial's configuration",
                 "a trial configuration this version reads")


def ran_config(folder: str | Path) -> TrialConfig:
    """What Tune ran as the trial: the configuration built from its `params.json` (the searched values and the
    experiment's fixed settings), as the trainable builds it."""
    return _read(folder, "params.json", TrialConfig.from_params, "what the trial ran",
                 "the parameters of a taylor_tune trial")


def agreed_config(chosen: Chosen, *, trust_remote_code: bool = False) -> TrialConfig:
    """The trial's recorded configuration (config.json), checked before anything loads: it must be what Tune ran
    (`ran_config`) for the model the report chose, field by field. `trust_remote_code` is the user's, from the
    command: a file in the sweep never turns it on (the sweep's files are data, and whoever can write them would
    otherwise choose the code an export runs)."""
    recorded = trial_config(chosen.folder)
    ran = ran_config(chosen.folder)
    old, new = flat(recorded.record()), flat(ran.record())
    differ = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    if differ or recorded.prune.model != chosen.model:
        said = (f"{', '.join(differ[:4])} differ from its params.json" if differ
                else f"its model {recorded.prune.model!r} is not the report's {chosen.model!r}")
        where = f"{str(chosen.folder).rstrip('/')}/config.json"
        raise ExportError(f"{where} is not what trial {chosen.trial_id} ran ({said}); not rebuilt: the trial's "
                          "record was changed since the sweep")
    if recorded.prune.trust_remote_code and not trust_remote_code:
        raise ExportError(f"trial {chosen.trial_id} ran its model's own code (trust_remote_code); the export runs it "
                          "only when you say so: add --trust-remote-code if you trust that model")
    return recorded.model_copy(update={"prune": recorded.prune.model_copy(
        update={"trust_remote_code": trust_remote_code})})


def rebuild(chosen: Chosen, work: Path, *, trust_remote_code: bool = False) -> Rebuilt:
    """Run the chosen trial's model-building stages again in `work` (a scratch folder: the pruning's record goes
    there, never into the sweep), then its perplexity; ExportError when a number does not come back."""
    recorded = agreed_config(chosen, trust_remote_code=trust_remote_code)
    if recorded.prune.device.startswith("cuda") and not torch.cuda.is_available():
        raise ExportError(f"trial {chosen.trial_id} ran on {recorded.prune.device}: export it where there is a GPU "
                          "(its numbers are checked on the device type they were measured on)")
    trial = recorded.model_copy(update={"cache_dir": None})  # computed afresh (module docstring)
    Path(work).mkdir(parents=True, exist_ok=True)
    run = TrialRun(trial, Path(work), {})
    for stage in [*pruning_stages(), *([Stage("recovery", recovery.recover)] if trial.recovery is not None else [])]:
        run.metrics |= stage.run(run) or {}
    checks = {}
    if "params_count" in chosen.row:
        checks["params_count"] = (chosen.row["params_count"], run.metrics["params_count"])
    if trial.recovery is not None and "recovery_heldout_loss" in chosen.row:
        checks["recovery_heldout_loss"] = (chosen.row["recovery_heldout_loss"], run.metrics["recovery_heldout_loss"])
    if trial.evaluation.ppl is not None and "ppl" in chosen.row:
        evaluation.start(run)
        passes = [evaluation.perplexity_pass(i)(run) for i in range(len(trial.evaluation.ppl_fidelities))]
        checks["ppl"] = (chosen.row["ppl"], passes[-1]["ppl"])  # over the windows the last pass reported
    _check(chosen, checks)
    return Rebuilt(recorded, run, checks)


def _check(chosen: Chosen, checks: dict) -> None:
    tolerances = {"params_count": 0.0, "recovery_heldout_loss": LOSS_TOLERANCE, "ppl": PPL_TOLERANCE}
    for name, (reported, rebuilt) in checks.items():
        if not math.isclose(float(reported), float(rebuilt), rel_tol=tolerances[name], abs_tol=0.0):
            raise ExportError(
                f"trial {chosen.trial_id}: the rebuilt model's {name} is {rebuilt!r}, the trial reported {reported!r} "
                f"(relative tolerance {tolerances[name]:g}); not written: the configuration, its calibration data or "
                "the packages changed since the sweep")
    if "ppl" not in checks and "recovery_heldout_loss" not in checks:
        raise ExportError(f"trial {chosen.trial_id} reported no held-out perplexity (evaluation.ppl: null) to check "
                          "a rebuild against; not written")
