"""Turn an experiment's declarative search space into a Tune `param_space`.

Grid search: every searched dimension (and the models, and the calibration seeds when repeats > 1) becomes
`tune.grid_search`. TPE has no param_space: its searcher (`search.PerModelSearcher`) proposes each trial.
The fixed settings ride along under `fixed`, so that every trial's config (and `Tuner.restore`) carries them.
"""

from __future__ import annotations

from ray import tune

from taylor_tune.sweep.experiment import Experiment


def fixed_settings(experiment: Experiment, cache_dir: str | None) -> dict:
    return {
        "prune": dict(experiment.prune), "evaluation": experiment.evaluation.model_dump(),
        "sample_counts": list(experiment.sample_counts()), "cache_dir": cache_dir,
        "recovery": None if experiment.recovery is None else experiment.recovery.model_dump(),
        # what the sweep optimizes: status, report and replays rank trials by it, as Tune did
        "objective": {"metric": experiment.metric, "mode": experiment.mode},
        # every objective of a multi-objective search (the first is `objective`): the report's Pareto front
        "objectives": [{"metric": metric, "mode": mode} for metric, mode in experiment.objective_list],
    }


def param_space(experiment: Experiment, cache_dir: str | None) -> dict:
    """The grid's param_space (TPE proposes its trials through `search.PerModelSearcher` instead)."""
    seeds = list(range(experiment.search.repeats))
    space = {name: tune.grid_search(list(domain.values)) for name, domain in experiment.search_space.domains().items()}
    space["model"] = tune.grid_search(list(experiment.models))
    space["seed"] = tune.grid_search(seeds) if len(seeds) > 1 else seeds[0]
    space["fixed"] = fixed_settings(experiment, cache_dir)
    return space
