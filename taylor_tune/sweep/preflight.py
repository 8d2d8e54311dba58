"""What `prune` checks before it loads weights, checked for every point of a sweep's space before Ray starts.

A trial that cannot succeed (a sparsity no plan reaches, more calibration tokens than the text holds) would
otherwise fail in every try on the cluster, one after another, and exit after the whole sweep. Here each model is
built on the meta device (its shapes, no weights, no memory) and every method of the space plans at the sweep's
sparsity from uniform scores: where a plan is impossible, it is impossible whatever the scores. The largest
calibration draw each model's tokenizer makes is drawn once.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch

from taylor_tune.config import check_schedule
from taylor_tune.errors import CalibrationError, ConfigError, ModelLoadError, PlanError
from taylor_tune.pruning.prune import check_plan, draw_calibration, draws_calibration, meta_layout, uses_gradients
from taylor_tune.schema import DIMENSIONS
from taylor_tune.sources.data import resolve_text
from taylor_tune.sources.models import load_model_config, load_tokenizer, streamable
from taylor_tune.sources.recovery_data import check_recovery_data
from taylor_tune.sweep import memory
from taylor_tune.sweep.experiment import Experiment

# The dimensions a plan depends on: every pruning dimension but those that change only the scores (seq_len,
# num_samples and the calibration text), so that a new searchable setting is planned at each of its values unless
# it is declared here as score-only; and those that decide whether a trial draws calibration at all.
SCORE_ONLY = ("taylor_seq_len", "taylor_num_samples", "calibration")
PLAN_FIELDS = tuple(name for name in DIMENSIONS if name not in SCORE_ONLY)
DRAW_FIELDS = ("pruning_method", "criterion", "uniform", "servable", "blockwise_attention", "calibration")


def _distinct(experiment: Experiment, fields: tuple[str, ...]) -> list[dict]:
    """The space's points restricted to `fields`, each once."""
    seen = {}
    for point in experiment.space_points():
        part = {k: v for k, v in point.items() if k in fields}
        seen.setdefault(repr(sorted(part.items())), part)
    return list(seen.values())


def check_plans(experiment: Experiment) -> None:
    """Every planning setting of the space reaches its sparsity on every model (PlanError -> one line)."""
    trust = bool(experiment.prune.get("trust_remote_code"))
    points = _distinct(experiment, PLAN_FIELDS)
    for model in experiment.models:
        layout = meta_layout(model, trust_remote_code=trust)
        for point in points:
            config = experiment.prune_config(model, point)
            try:
                check_plan(config, layout)
            except PlanError as error:
                named = ", ".join(f"{k} {v}" for k, v in point.items() if k != "pruning_method")
                raise ConfigError(
                    f"prune: {config.method} on {model} cannot be planned with these settings"
                    f"{f' ({named})' if named else ''}: {error}"
                ) from None


def check_calibration_sizes(experiment: Experiment) -> None:
    """Each model's calibration text holds the largest draw of the space (seq_len x num_samples tokens)."""
    trust = bool(experiment.prune.get("trust_remote_code"))
    longest = max(experiment.values_of("taylor_seq_len"))
    most = max(experiment.values_of("taylor_num_samples"))
    points = _distinct(experiment, DRAW_FIELDS)
    for model in experiment.models:
        largest = {}  # one draw per text a point reads
        for point in points:
            config = experiment.prune_config(model, point)
            if draws_calibration(config):
                largest.setdefault(resolve_text(config.calibration, model),
                                   config.model_copy(update={"seq_len": longest, "num_samples": most, "seed": 0}))
        for config in largest.values():
            try:
                draw_calibration(config, load_tokenizer(model, trust_remote_code=trust))
            except CalibrationError as error:
                raise ConfigError(f"search_space: the largest draw of {model} ({most} x {longest} tokens) does not "
                                  f"fit: {error}") from None


def memory_bytes() -> int:
    """This machine's physical memory: the bound of what one trial may allocate before its model is even loaded."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_recovery(experiment: Experiment) -> None:
    """Every recovery of the space can do what its settings say, on every model, before Ray starts: a warm-up no
    longer than the steps, a LoRA rank no
    larger than the model's hidden size (every targeted projection has it on one side, so an update's rank cannot
    exceed it: a larger rank only adds memory, 100,000 took 8-10 GB of a 96-wide model), and the recovery data
    (`sources.recovery_data.check_recovery_data`): its size bounded, the text holding the draw, responses kept."""
    if experiment.recovery is None:
        return
    trust = bool(experiment.prune.get("trust_remote_code"))
    points = experiment.space_points()
    for point in points:
        problem = experiment.prune_config(experiment.models[0], point).recovery_problem()
        if problem:
            raise ConfigError(f"recovery: {problem}; remove the recovery block")
    specs = {spec.model_dump_json(): spec for spec in map(experiment.recovery_spec, points)}
    for spec in specs.values():
        check_schedule(spec)
    for model in experiment.models:
        hidden = load_model_config(model, trust_remote_code=trust).hidden_size
        tokenizer = load_tokenizer(model, trust_remote_code=trust)
        for spec in specs.values():
            if spec.lora_rank > hidden:
                raise ConfigError(f"recovery.lora_rank: {spec.lora_rank} is larger than {model}'s hidden size "
                                  f"{hidden}; a LoRA update's rank cannot exceed it, so a larger rank adds only "
                                  f"memory: choose at most {hidden}")
            try:
                check_recovery_data(tokenizer, spec, model, memory_bytes())
            except CalibrationError as error:
                raise ConfigError(f"{error} (recovery of {model})") from None


def _check_streamed(model: str, prune, shape, peaks, dtype_bytes: int, allowed: int, where: str, on_gpu: bool) -> None:
    """A streamed point's peaks where their parts live (`memory.streamed_places`: the device, the host, the scratch
    disk with the pruned model), each against what that place has; refused in one line naming the place."""
    scratch = os.environ.get("TAYLOR_TUNE_SCRATCH") or tempfile.gettempdir()
    try:
        free = shutil.disk_usage(scratch).free
    except OSError:
        raise ConfigError(f"TAYLOR_TUNE_SCRATCH: {scratch} is not a folder a streamed trial can write to") from None
    host = memory_bytes()
    have = {"device": (allowed, where), "host": (host, f"this machine's {host / memory.GIB:.1f} GiB"),
            "scratch disk": (free, f"the {free / memory.GIB:.1f} GiB free in {scratch} (TAYLOR_TUNE_SCRATCH)")}
    for peak in peaks:
        needs = memory.streamed_places(peak, on_gpu, host)
        needs["scratch disk"] = needs.get("scratch disk", 0) + memory.pruned_bytes(shape, prune, dtype_bytes)
        for place, need in needs.items():
            bound, what = have[place]
            if need <= bound:
                continue
            if place == "scratch disk":
                raise ConfigError(f"memory: {prune.method} on {model}, streamed: its pruned model and what the "
                                  f"{peak.stage} keeps need at least {need / memory.GIB:.1f} GiB on the scratch "
                                  f"disk, more than {what}")
            raise ConfigError(f"memory: {prune.method} on {model}, streamed: the {peak.stage} needs at least "
                              f"{need / memory.GIB:.1f} GiB on the {place}, more than {what}; lower {peak.levers}")


def check_streaming(experiment: Experiment) -> None:
    """Every point that streams by its setting (`streaming: on`) can: its model a folder of safetensors (not a tiny
    model built in memory, not a hub id), and no stage that holds the whole model (the speed measurement, a
    recovery). `auto` is decided per trial on its device; a trial that streams there is held to the same."""
    for model in experiment.models:
        for point in experiment.space_points():
            prune = experiment.prune_config(model, point)
            if prune.streaming != "on":
                continue
            try:
                streamable(model, trust_remote_code=prune.trust_remote_code)
            except ModelLoadError as error:
                raise ConfigError(f"streaming: on, but {error}") from None
            held = memory.held_whole(experiment.evaluation, experiment.recovery_spec(point))
            if held:
                raise ConfigError(f"streaming: on holds {model} one layer at a time, which {held} cannot be; drop "
                                  "it or set streaming: off")


def _on_gpu(experiment: Experiment) -> bool:
    device = str(experiment.prune.get("device", "auto"))
    return device.startswith("cuda") or (device == "auto" and experiment.resources.gpu != 0
                                         and torch.cuda.is_available())


def trial_memory(experiment: Experiment) -> tuple[int, int, str] | None:
    """(bytes one trial may use, its weights' bytes per value, what bounds it) on this machine; None where this
    machine cannot tell (a cluster's driver: the trials run on nodes it does not see). A CPU trial may use
    `resources.memory`, or else the machine's memory; a GPU trial its GPU's times its share (`resources.gpu`)."""
    if os.environ.get("RAY_ADDRESS"):
        return None
    gpu = experiment.resources.gpu
    dtype = str(experiment.prune.get("dtype", "auto"))
    if _on_gpu(experiment):
        if not torch.cuda.is_available():
            return None
        share = 1.0 if gpu == "auto" else min(1.0, float(gpu))
        total = torch.cuda.get_device_properties(0).total_memory
        bytes_per = 4 if dtype == "float32" else 2
        name = torch.cuda.get_device_name(0)
        return int(total * share), bytes_per, f"{share:g} x {name}'s {total / memory.GIB:.1f} GiB"
    bytes_per = 2 if dtype in ("bfloat16", "float16") else 4
    if experiment.resources.memory is not None:
        return int(experiment.resources.memory * memory.GIB), bytes_per, \
            f"the {experiment.resources.memory:g} GiB of resources.memory"
    return memory_bytes(), bytes_per, f"this machine's {memory_bytes() / memory.GIB:.1f} GiB"


def check_memory(experiment: Experiment) -> None:
    """Every point of the space, on every model, fits what one trial may use (`trial_memory`): its estimated peak
    (`sweep.memory`) from the model's shape and the point's settings. Refused in one line naming the stage, its
    parts and the settings that size it."""
    bound = trial_memory(experiment)
    if bound is None:
        return
    allowed, dtype_bytes, where = bound
    trust = bool(experiment.prune.get("trust_remote_code"))
    for model in experiment.models:
        config = load_model_config(model, trust_remote_code=trust)
        layout = meta_layout(model, trust_remote_code=trust)
        shape = memory.Shape.of(config, layout.total_params, sum(layout.layer_params))
        for point in experiment.space_points():
            prune = experiment.prune_config(model, point)
            peaks = memory.trial_peaks(shape, prune, experiment.evaluation, experiment.recovery_spec(point),
                                       dtype_bytes, draws_calibration=draws_calibration(prune),
                                       uses_gradients=uses_gradients(prune))
            streamed = memory.streams(prune, peaks, allowed)
            if streamed:  # held one layer at a time: its own peaks, and no stage that holds the whole model
                held = memory.held_whole(experiment.evaluation, experiment.recovery_spec(point))
                if held:
                    raise ConfigError(f"streaming: {model} does not fit {where} whole, so it streams, which {held} "
                                      "cannot; drop it, or set streaming: off to be refused for its memory")
                peaks = memory.streamed_peaks(shape, prune, experiment.evaluation, dtype_bytes)
                _check_streamed(model, prune, shape, peaks, dtype_bytes, allowed, where, _on_gpu(experiment))
                continue
            worst = max(peaks, key=lambda peak: peak.total, default=None)
            if worst is not None and worst.total > allowed:
                hint = "" if streamed or prune.streaming == "off" else (
                    f" (it cannot stream: {prune.streaming_problem()})" if prune.streaming_problem() else "")
                raise ConfigError(f"memory: {prune.method} on {model}: {memory.describe(worst)} at its peak, more "
                                  f"than {where}; lower {worst.levers}{hint}")
