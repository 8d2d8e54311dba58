"""The speed stages of a trial: the unpruned model's speed (once per model, dtype, machine and settings in a sweep)
and the pruned model's, timed under the node's timing lock, and their ratios."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import torch

from taylor_tune.evaluation.speed import SPEEDUPS, checked_speed, measure_speed, speed_ratios
from taylor_tune.jsonio import built_once, digest
from taylor_tune.pruning.prune import layer_shapes
from taylor_tune.sources.models import load_model, resolve_device, resolve_dtype
from taylor_tune.sweep.lock import timing_lock
from taylor_tune.sweep.stages.run import TrialConfig, TrialRun

log = logging.getLogger(__name__)

# A speedup beyond this factor either way is read as a damaged unpruned record, not a measurement: no structured
# pruning the tool allows makes a model twenty times faster or slower
PLAUSIBLE_SPEEDUP = 20.0


def machine(device: torch.device) -> str:
    """What a speed measurement is of: the GPU's name, or this host's CPU (a sweep's nodes may differ)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu@{socket.gethostname()}"


def unpruned_speed(trial: TrialConfig, *, again: bool = False) -> tuple[dict, float | None]:
    """The unpruned model's speed (`measure_speed`) on this trial's device, and the seconds measuring it cost this
    trial (None when read). Measured once per model, dtype, device and settings in a sweep: the first trial to ask
    measures under a file lock, the others read its result. `again`: the sweep's record is dropped and measured anew
    (a record the trial's own measurement shows to be implausible)."""
    config, spec = trial.prune, trial.evaluation.speed
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)

    def measure() -> tuple[dict, float]:
        start = time.perf_counter()
        model = load_model(config.model, device=device, dtype=dtype, trust_remote_code=config.trust_remote_code,
                           seed=config.seed)
        with timing_lock():
            measured = measure_speed(model, spec, seed=config.seed)
        del model  # before the trial loads its own copy
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return measured, time.perf_counter() - start

    if trial.cache_dir is None:
        return measure()
    fields = {"model": config.model, "dtype": str(dtype), "device": machine(device), "speed": spec.model_dump()}
    path = Path(trial.cache_dir).parent / "unpruned_speed" / f"{digest(fields)[:24]}.json"
    spent = {}

    def build() -> dict:
        measured, spent["seconds"] = measure()
        return measured

    if again:
        path.unlink(missing_ok=True)
    measured, _ = built_once(path, fields, build, checked_speed, part="measured")
    return measured, spent.get("seconds")


def measure_unpruned(run: TrialRun) -> dict:
    if run.trial.evaluation.speed is None:
        return {}
    run.unpruned, seconds = unpruned_speed(run.trial)
    run.unpruned_read = seconds is None
    if run.on_gpu:
        torch.cuda.reset_peak_memory_stats()
    return {} if seconds is None else {"unpruned_speed_s": seconds}  # None: read from the sweep's record


def plausible(ratios: dict) -> bool:
    return all(1 / PLAUSIBLE_SPEEDUP <= ratios[k] <= PLAUSIBLE_SPEEDUP for k in SPEEDUPS)


def measure_pruned(run: TrialRun) -> dict:
    """The pruned model's speed, timed under the node's timing lock (no other trial times at the same moment; the
    window is reported as speed_timed_from / _to, epoch seconds); in a sweep, a model whose layer shapes an earlier
    trial of the sweep timed on the same machine, dtype and settings reads that measurement (speed_reused)."""
    start, spec, model = time.perf_counter(), run.trial.evaluation.speed, run.pruning.model
    timing: dict = {}

    def measure() -> dict:
        with timing_lock() as waited:
            timing["speed_timed_from"] = time.time()
            measured = measure_speed(model, spec, seed=run.config.seed)
            timing["speed_timed_to"] = time.time()
        timing["speed_wait_s"] = waited
        return measured

    if run.trial.cache_dir is None:
        measured = measure()
    else:
        parameter = next(model.parameters())
        fields = {"model": run.config.model, "dtype": str(parameter.dtype), "device": machine(parameter.device),
                  "speed": spec.model_dump(), "layers": layer_shapes(model)}
        path = Path(run.trial.cache_dir).parent / "pruned_speed" / f"{digest(fields)[:24]}.json"
        measured, _ = built_once(path, fields, measure, checked_speed, part="measured")
    ratios, again = speed_ratios(measured, run.unpruned), {}
    if run.unpruned_read and not plausible(ratios):  # a record damaged in a way its checks cannot see: measure it
        log.warning("the sweep's unpruned speed record gives %s against this trial's own measurement: measured "
                    "again", ", ".join(f"{k} {ratios[k]:.3g}" for k in SPEEDUPS))
        run.unpruned, seconds = unpruned_speed(run.trial, again=True)
        ratios, again = speed_ratios(measured, run.unpruned), {"unpruned_speed_s": seconds or 0.0}
    return (measured | ratios | {f"unpruned_{k}": v for k, v in run.unpruned.items()} | again
            | timing | {"speed_reused": not timing, "stage": "speed", "speed_s": time.perf_counter() - start})
