"""The pruning's stages in a trial: pruning's own stage functions (`pruning.prune.STAGES`), started with the sweep's
shared importance cache, and the pruning's record written to the trial's folder."""

from __future__ import annotations

from collections.abc import Callable

from taylor_tune.pruning import prune as pruning
from taylor_tune.pruning.prune import ImportanceCache
from taylor_tune.sweep.stages.run import Stage, TrialRun


def start(run: TrialRun) -> dict:
    """Checks against the model's config, the tokenizer, and the shared importance cache when the sweep has one."""
    store = run.store("importance_cache")
    cache = None if store is None else ImportanceCache(store)
    run.pruning = pruning.start(run.config, cache=cache, sample_counts=run.trial.sample_counts)
    return {}


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
