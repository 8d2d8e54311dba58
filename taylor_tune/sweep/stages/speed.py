"""The speed stage of a trial: the pruned model timed against the unpruned one, interleaved in one window under the
node's timing lock (`evaluation.speed.measure_paired`), so that every speedup is a ratio of pairs run side by side
with its own interval; a same-shape model of the sweep reads that measurement."""

from __future__ import annotations

import logging
import socket
import time

import torch

from taylor_tune.evaluation.speed import checked_paired, measure_paired
from taylor_tune.pruning.prune import layer_shapes
from taylor_tune.sources.models import load_model
from taylor_tune.storage.cache import built_json
from taylor_tune.sweep.lock import timing_lock
from taylor_tune.sweep.stages.run import TrialRun

log = logging.getLogger(__name__)
# A speedup beyond PLAUSIBLE_SPEEDUP measured by the trial itself is a disturbed window (the machine busy with other
# work during runs of milliseconds), not the model: the pair is timed again, in this many windows at most
WINDOWS = 3


def machine(device: torch.device) -> str:
    """What a speed measurement is of: the GPU's name, or this host's CPU (a sweep's nodes may differ)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu@{socket.gethostname()}"


def time_pair(run: TrialRun, timing: dict) -> dict:
    """The pruned model and the unpruned one (loaded as the trial loaded the model it pruned, for this window only)
    timed in turn under the node's timing lock, again where a speedup comes out implausible (`WINDOWS`); `timing`
    gets the window (speed_timed_from / _to, epoch seconds) and the wait for the lock (speed_wait_s)."""
    config, model = run.config, run.pruning.model
    parameter = next(model.parameters())
    if run.on_gpu:  # the trial's peak before a second model joins the pruned one (the last report carries it)
        run.peak_gpu_bytes = max(run.peak_gpu_bytes, torch.cuda.max_memory_allocated())
    baseline = load_model(config.model, device=parameter.device, dtype=parameter.dtype,
                          trust_remote_code=config.trust_remote_code, seed=config.seed)
    with timing_lock() as waited:
        timing["speed_timed_from"] = time.time()
        for window in range(1, WINDOWS + 1):
            measured = measure_paired(model, baseline, run.trial.evaluation.speed, seed=config.seed)
            try:
                checked_paired(measured)
                break
            except ValueError as error:
                if window == WINDOWS:
                    raise ValueError(f"{error} in each of {WINDOWS} windows: the timed runs are too short for the "
                                     "machine's other work; raise evaluation.speed repeats or new_tokens") from None
                log.warning("%s; timing the pair again (window %d of %d)", error, window + 1, WINDOWS)
        timing["speed_timed_to"] = time.time()
    timing["speed_wait_s"] = waited
    del baseline
    if run.on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return measured


def measure(run: TrialRun) -> dict:
    """The speed stage (`time_pair`); in a sweep, a model whose layer shapes an earlier trial of the sweep timed on
    the same machine, dtype and settings reads that measurement (speed_reused), unless its record is damaged (then
    timed again)."""
    start, timing = time.perf_counter(), {}
    store = run.store("paired_speed")
    if store is None:
        measured = time_pair(run, timing)
        checked_paired(measured)  # what a reused record must be, a fresh one too
    else:
        parameter = next(run.pruning.model.parameters())
        fields = {"model": run.config.model, "dtype": str(parameter.dtype), "device": machine(parameter.device),
                  "speed": run.trial.evaluation.speed.model_dump(), "layers": layer_shapes(run.pruning.model)}
        measured, _ = built_json(store, fields, lambda: time_pair(run, timing), checked_paired, part="measured")
    return measured | timing | {"speed_reused": not timing, "stage": "speed", "speed_s": time.perf_counter() - start}
