"""TPE for the sweep: one Optuna TPE study per model, behind one Tune searcher.

The best configuration differs per model, so each model gets its own study (sharing one would let TPE
spend the budget on whichever model scores highest). The searcher hands out trials to the models in turn,
`num_trials` each, and routes every result back to the study that proposed it. Its state pickles, so
`Tuner.restore` resumes the studies too.
"""

from __future__ import annotations

import pickle

from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch


class ChoiceSpace:
    """An Optuna define-by-run space: one categorical per dimension (a class, not a lambda, so it pickles)."""

    def __init__(self, domains: dict[str, list]):
        self.domains = domains

    def __call__(self, trial) -> None:
        for name, values in self.domains.items():
            trial.suggest_categorical(name, values)


def define_by_run(experiment) -> ChoiceSpace:
    return ChoiceSpace({name: list(domain.values) for name, domain in experiment.search_space.domains().items()})


class PerModelSearcher(Searcher):
    def __init__(self, models, space: ChoiceSpace, trials_per_model: int, fixed: dict, *, metric: str, mode: str, seed: int = 0):
        super().__init__(metric=metric, mode=mode)
        from optuna.samplers import TPESampler

        self.models = list(models)
        self.trials_per_model = trials_per_model
        self.fixed = fixed
        self.studies = {
            model: OptunaSearch(space=space, metric=metric, mode=mode, sampler=TPESampler(seed=seed + i))
            for i, model in enumerate(self.models)
        }
        self.proposed = {model: 0 for model in self.models}
        self.owner: dict[str, str] = {}

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True  # the studies were built with their space, metric and mode

    def suggest(self, trial_id: str):
        waiting = [m for m in self.models if self.proposed[m] < self.trials_per_model]
        if not waiting:
            return Searcher.FINISHED
        model = min(waiting, key=lambda m: self.proposed[m])
        params = self.studies[model].suggest(trial_id)
        if params is None or params == Searcher.FINISHED:
            return params
        self.proposed[model] += 1
        self.owner[trial_id] = model
        return {**params, "model": model, "seed": 0, "fixed": self.fixed}

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if trial_id in self.owner and self.metric in result:
            self.studies[self.owner[trial_id]].on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id not in self.owner:
            return
        usable = result is not None and self.metric in result
        self.studies[self.owner[trial_id]].on_trial_complete(trial_id, result if usable else None, error=error or not usable)

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__dict__.copy(), f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))
