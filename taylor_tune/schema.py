"""The names a trial's results travel under, built and parsed here and nowhere else.

A trial reports flat metrics to Tune (and writes them to `evaluation.json`); the driver, the Ray metrics, the
console, `status` and the report read them back. The configuration columns (`model`, `pruning_method`,
`taylor_seq_len`, `taylor_num_samples`, `seed`: the source tables' spelling; and every other search dimension),
the stage names and their
`<stage>_s` / `<stage>_tokens` timings, and the per-task `acc_<task>[_stderr|_n|_sel|_heldout]` columns are
defined below. Pure: imports neither torch nor ray.
"""

from __future__ import annotations

from taylor_tune.config import CRITERIA, METHOD_CRITERIA, ZERO_SHOT_TASKS, PruneConfig, RecoverySpec, dimensions

# Search dimensions and the PruneConfig fields they set, derived from the fields marked `config.searchable` (one
# declaration per setting): the paper's three first, as the source tables spell them, then every other pruning
# setting a search may vary under its own name, in the class's order. Every trial reports all of them as columns.
PAPER_DIMENSIONS = ("taylor_seq_len", "taylor_num_samples", "pruning_method")


def prune_dimensions(config_class: type = PruneConfig) -> dict[str, str]:
    """{dimension: PruneConfig field} of `config_class` (a subclass with more marked fields gains them)."""
    marked = dimensions(config_class)
    return {k: marked[k] for k in PAPER_DIMENSIONS if k in marked} | marked


DIMENSIONS = prune_dimensions()
# Recovery settings a search may vary and the RecoverySpec fields they set; searching one needs the experiment's
# `recovery` block (which fixes the others). A recovered trial reports all of them as columns.
RECOVERY_DIMENSIONS = dimensions(RecoverySpec)
# Every dimension a search space may name.
SEARCHABLE = (*DIMENSIONS, *RECOVERY_DIMENSIONS)
# What identifies a trial's configuration in every table.
# the methods that rank by PruneConfig.criterion (pruning.methods' Scoring.CRITERION): the report names a method with
# another criterion than taylor as method+criterion (taylor+flap, layerwise+wanda_sp), so the baselines compare apart
CRITERION_METHODS = tuple(method for method, used in METHOD_CRITERIA.items() if used == CRITERIA)
CONFIG_COLUMNS = ("model", "pruning_method", "taylor_seq_len", "taylor_num_samples", "seed")

# The names a trial's timings go by (`<name>_s`), in the order they are taken; each zero-shot pass times itself as a
# name of its own. Not the trial's stages (`sweep.trial.trial_stages`): pruning's load, score, plan and apply stages
# time load, calibration, importance and prune. speed: the pruned model timed in turn with the unpruned one.
STAGES = ("load", "calibration", "importance", "prune", "speed", "before_recovery", "recovery", "ppl")
SECONDS_SUFFIX, TOKENS_SUFFIX = "_s", "_tokens"
_ZERO_SHOT = "zero_shot_"
_REQUESTS = "_requests"
_RECOVERY, RECOVERED = "recovery_", "recovered"
BEFORE_RECOVERY = "before_recovery_"
# Per-task columns beside acc_<task>: its stderr, the items scored, and the two halves of held-out selection.
TASK_SUFFIXES = ("_stderr", "_n", "_sel", "_heldout")


def config_columns(model: str, method: str, seq_len: int, num_samples: int, seed: int) -> dict:
    """The configuration columns of one trial."""
    return {"model": model, "pruning_method": method, "taylor_seq_len": seq_len, "taylor_num_samples": num_samples,
            "seed": seed}


def zero_shot_stage(limit: int | None) -> str:
    """The stage a zero-shot pass at `limit` items per task reports; None = every item."""
    return f"{_ZERO_SHOT}{limit or 'all'}"


def recovery_stage(step: int | None) -> str:
    """The stage a point of the recovery's held-out loss curve reports: `recovery_<step>` during the recovery,
    `recovered` (step None) at its end, after the adapters are merged."""
    return RECOVERED if step is None else f"{_RECOVERY}{step}"


def is_recovery_stage(stage: object) -> bool:
    return isinstance(stage, str) and (stage == RECOVERED or stage.startswith(_RECOVERY))


def before_recovery_key(metric: str) -> str:
    """A metric of the pruned model before its recovery (`recovery.evaluate_before`), beside the recovered one's."""
    return BEFORE_RECOVERY + metric


def seconds_key(stage: str) -> str:
    return stage + SECONDS_SUFFIX


def tokens_key(stage: str) -> str:
    return stage + TOKENS_SUFFIX


def requests_key(stage: str, part: str = SECONDS_SUFFIX) -> str:
    """Of a zero-shot pass: `<stage>_requests_s`, the seconds it spent building (or reading) and tokenizing its
    requests, a part of its `<stage>_s`; `<stage>_requests_built` (part "_built"), the tasks whose requests it built
    (0: every task's read from the sweep's request cache)."""
    return stage + _REQUESTS + part


def stage_seconds(metrics: dict) -> dict[str, float]:
    """{stage: seconds} of the stages a cumulative report holds (its `<stage>_s` numbers)."""
    out = {}
    for key, value in metrics.items():
        if not key.endswith(SECONDS_SUFFIX) or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        stage = key[: -len(SECONDS_SUFFIX)]
        if stage in STAGES or (stage.startswith(_ZERO_SHOT) and not stage.endswith(_REQUESTS)):
            out[stage] = value
    return out


RACE_OBJECTIVES = ("acc_mean", "ppl")  # what a race compares: per-item outcomes, or perplexity windows


def task_key(task: str, part: str = "") -> str:
    """`acc_<task>` (the task's score in the metric acc_mean averages), or one of its TASK_SUFFIXES columns."""
    if part and part not in TASK_SUFFIXES:
        raise ValueError(f"unknown task column part {part!r}; one of {', '.join(TASK_SUFFIXES)}")
    return f"acc_{task}{part}"


def task_of(column: str) -> str | None:
    """The task of an `acc_<task>` score column; None for acc_mean, a TASK_SUFFIXES column or anything else."""
    if not column.startswith("acc_") or column == "acc_mean" or column.startswith("acc_mean_"):
        return None
    if column.endswith(TASK_SUFFIXES):
        return None
    return column[len("acc_"):]


def task_columns(columns) -> tuple[str, ...]:
    """The zero-shot tasks present as `acc_<task>` columns: the paper's order first, then any others by name."""
    found = {task for task in map(task_of, columns) if task}
    return tuple(t for t in ZERO_SHOT_TASKS if t in found) + tuple(sorted(found - set(ZERO_SHOT_TASKS)))


# The measured-speed metrics a trial reports when its evaluation measures speed (> 1 = faster; memory < 1 = smaller).
SPEED_METRICS = ("prefill_speedup", "decode_speedup", "decode_batch_speedup", "memory_ratio")
# The direction in which each objective metric is better (an accuracy acc_<task>: max).
BETTER = {"acc_mean": "max", "ppl": "min", "params_count": "min", "pruning_ratio": "max", "prefill_speedup": "max",
          "decode_speedup": "max", "decode_batch_speedup": "max", "memory_ratio": "min"}


def objective_metrics(tasks, speed: bool = False) -> list[str]:
    """Every metric a sweep over `tasks` can rank by (with `speed`, the measured-speed ones too)."""
    return ["acc_mean", "ppl", *(task_key(t) for t in tasks), "params_count", "pruning_ratio",
            *(SPEED_METRICS if speed else ())]


def better(metric: str) -> str:
    """max or min: the direction in which `metric` improves."""
    return BETTER.get(metric, "max")
