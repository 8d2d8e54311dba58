"""The pruning's stages in a trial: pruning's own stage functions (`pruning.prune.STAGES`), started with the sweep's
shared importance cache, and the pruning's record written to the trial's folder."""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from taylor_tune.errors import ConfigError
from taylor_tune.pruning import prune as pruning
from taylor_tune.pruning.prune import ImportanceCache
from taylor_tune.sources.models import load_model_config, resolve_device, resolve_dtype
from taylor_tune.sweep import memory
from taylor_tune.sweep.preflight import memory_bytes
from taylor_tune.sweep.stages.run import Stage, TrialConfig, TrialRun


def start(run: TrialRun) -> dict:
    """Checks against the model's config, the tokenizer, and the shared importance cache when the sweep has one;
    whether the trial streams its model (`streaming`: auto decided by the memory estimate against this trial's
    device), its `streamed` column."""
    store = run.store("importance_cache")
    cache = None if store is None else ImportanceCache(store)
    streamed = trial_streams(run.trial)
    if streamed:  # outside the trial's folder, which Tune copies to the sweep's storage as it goes
        run.scratch = Path(tempfile.mkdtemp(prefix="taylor-tune-streamed-", dir=os.environ.get(SCRATCH_VARIABLE)))
    on_disk = streamed and keeps_on_disk(run.config)
    run.pruning = pruning.start(run.config, cache=cache, sample_counts=run.trial.sample_counts,
                                pruned_folder=run.scratch / "model" if streamed else None,
                                kept_folder=run.scratch / "kept" if on_disk else None)
    return {"streamed": streamed} | ({"streamed_kept_on_disk": True} if on_disk else {})


def keeps_on_disk(config) -> bool:
    """Whether a streamed pass's activations go to the scratch folder (`memory.kept_on_disk`): what the gradient
    pass keeps between layers (`memory.streamed_importance`'s `kept`) against this machine's memory."""
    shape, dtype_bytes = _shape_of(config.model, config.trust_remote_code, config.dtype, config.device)
    kept = memory.streamed_importance(shape, config.num_samples, config.micro_batch_size, config.seq_len,
                                      dtype_bytes).parts["kept"]
    return memory.kept_on_disk(kept, memory_bytes())


@functools.lru_cache(maxsize=8)
def _shape_of(model: str, trust_remote_code: bool, dtype: str, device: str) -> tuple[memory.Shape, int]:
    """The memory estimate's view of a model (from its config and meta-device layout, no weights) and the bytes of
    a value in the dtype the pruning resolves on its device; once per model and settings in a process."""
    model_config = load_model_config(model, trust_remote_code=trust_remote_code)
    layout = pruning.meta_layout(model, trust_remote_code=trust_remote_code)
    dtype_bytes = torch.finfo(resolve_dtype(dtype, resolve_device(device))).bits // 8
    return memory.Shape.of(model_config, layout.total_params, sum(layout.layer_params)), dtype_bytes


# where a streamed trial writes its pruned model (the size of the model, read back layer by layer, removed at the
# trial's end): a folder of its own in this directory (default: the system's temporary directory)
SCRATCH_VARIABLE = "TAYLOR_TUNE_SCRATCH"


def trial_streams(trial: TrialConfig) -> bool:
    """`streams` for this trial's pruning, evaluation and recovery."""
    return streams(trial.prune, trial.evaluation, trial.recovery)


def streams(config, evaluation, recovery) -> bool:
    """`memory.streams` for a pruning on the device it runs on, against that device's whole memory (a GPU's, or this
    machine's on CPU). A streamed pruning with a speed measurement or a recovery is refused: both hold the whole
    model."""
    if config.streaming == "off":
        return False
    if config.streaming == "auto":
        device = resolve_device(config.device)
        allowed = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else memory_bytes()
        shape, dtype_bytes = _shape_of(config.model, config.trust_remote_code, config.dtype, config.device)
        peaks = memory.trial_peaks(shape, config, evaluation, recovery, dtype_bytes,
                                   draws_calibration=pruning.draws_calibration(config),
                                   uses_gradients=pruning.uses_gradients(config))
        if not memory.streams(config, peaks, allowed):
            return False
    held = memory.held_whole(evaluation, recovery)
    if held:
        raise ConfigError(f"streaming: {config.model} is held one layer at a time, which {held} cannot be; "
                          "drop it or set streaming: off")
    return True


def of_pruning(step: Callable[[pruning.Pruning], dict]) -> Stage:
    """A stage of pruning's own (load, score, plan, apply), its seconds kept in the pruning summary too."""

    def run_step(run: TrialRun) -> dict:
        timings = step(run.pruning)
        run.pruning.timings |= timings
        return timings

    return Stage(step.__name__, run_step)


def write_pruned(run: TrialRun) -> dict:
    """The pruning's files, and its columns: the configuration, what was removed, the importance cache's event."""
    return pruning.write_summary(run.pruning, run.trial_dir) | {"stage": "pruned"}


def pruning_stages() -> list[Stage]:
    return [Stage("start", start), *(of_pruning(step) for step in pruning.STAGES),
            Stage("pruned", write_pruned, reports=True)]
