"""TPE for the sweep: one Optuna TPE study per model, behind one Tune searcher.

With several objectives (`objectives` in the experiment) each study is multi-objective: Optuna's TPESampler then
models the trials' Pareto ranks (MOTPE), and the report draws the front.

The best configuration differs per model, so each model gets its own study (sharing one would let TPE
spend the budget on whichever model scores highest). The searcher hands out trials to the models in turn,
`num_trials` each, and routes every result back to the study that proposed it. Its state pickles, so
`Tuner.restore` resumes the studies too.

The space is finite (45 configurations for the paper grid), and TPE, which samples, proposes
configurations it has already seen more and more often as it converges (BENCHMARKS.md, search efficiency, measured
what running those again costs). So a study never hands out a configuration twice:
a repeated proposal is answered at once with the earlier result, as Optuna's FAQ recommends ("How can I
ignore duplicated samples?"), and after `patience` repeats in a row the study enqueues an unseen
configuration drawn at random, so that a converged TPE cannot stall the sweep.
"""

from __future__ import annotations

import math
import pickle
import random
from itertools import product

from ray.tune.search import Searcher


class ChoiceSpace:
    """An Optuna define-by-run space: one categorical per dimension (a class, not a lambda, so it pickles)."""

    def __init__(self, domains: dict[str, list]):
        self.domains = {name: list(values) for name, values in domains.items()}

    def __call__(self, trial) -> tuple:
        return tuple(trial.suggest_categorical(name, values) for name, values in self.domains.items())


def domains_of(experiment) -> dict[str, list]:
    return {name: list(domain.values) for name, domain in experiment.search_space.domains().items()}


class ModelStudy:
    """One model's TPE study over a finite space; `ask` returns each configuration at most once."""

    def __init__(
        self, domains: dict[str, list], *, seed: int, mode: str | tuple[str, ...], n_startup_trials: int = 10,
        patience: int = 10,
    ):
        """`mode`: max or min, or one per objective (a multi-objective study, told a tuple of values)."""
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.space = ChoiceSpace(domains)
        self.domains = self.space.domains
        self.size = math.prod(len(values) for values in self.domains.values())
        # constant_liar: with concurrent trials, TPE treats running ones as bad and looks elsewhere
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup_trials, constant_liar=True)
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
        self.study = optuna.create_study(directions=["maximize" if m == "max" else "minimize" for m in modes],
                                         sampler=sampler)
        self.rng = random.Random(seed)
        self.patience = patience
        self.results: dict[tuple, float | tuple | None] = {}  # configuration -> its result(s) (None: it failed)
        self.running: set[tuple] = set()  # handed out, result not back yet
        self.numbers: dict[tuple, int] = {}  # configuration -> the Optuna trial that runs it
        self.repeats_answered = 0

    def ask(self) -> dict | None:
        """The next configuration never handed out before, or None when every one has been."""
        from optuna.trial import TrialState

        repeats = 0
        while len(self.results) + len(self.running) < self.size:
            if repeats >= self.patience:
                unseen = [
                    key
                    for key in product(*self.domains.values())
                    if key not in self.results and key not in self.running
                ]
                self.study.enqueue_trial(dict(zip(self.domains, self.rng.choice(unseen))))
            trial = self.study.ask()
            key = self.space(trial)
            if key not in self.results and key not in self.running:
                self.running.add(key)
                self.numbers[key] = trial.number
                return dict(zip(self.domains, key))
            repeats += 1
            self.repeats_answered += 1
            if self.results.get(key) is None:  # still running, or it failed: nothing to answer with
                self.study.tell(trial, state=TrialState.FAIL)
            else:
                self.study.tell(trial, self.results[key])
        return None

    def tell(self, params: dict, value: float | tuple[float, ...] | None) -> None:
        """The result of a configuration `ask` handed out (one value per objective); None when it failed or reported
        no metric."""
        from optuna.trial import TrialState

        key = tuple(params[name] for name in self.domains)
        self.running.discard(key)
        self.results[key] = value
        if value is None:
            self.study.tell(self.numbers[key], state=TrialState.FAIL)
        else:
            self.study.tell(self.numbers[key], value)


class PerModelSearcher(Searcher):
    def __init__(self, models, domains: dict[str, list], trials_per_model: int, fixed: dict, *, metric: str, mode: str,
                 seed: int = 0, n_startup_trials: int = 10, objectives: tuple[tuple[str, str], ...] | None = None):
        """`objectives`: (metric, mode) of each objective when there are several; `metric`/`mode` are the first."""
        super().__init__(metric=metric, mode=mode)
        self.objectives = tuple(objectives or ((metric, mode),))
        modes = tuple(m for _, m in self.objectives)  # one objective: a study with one direction, as before
        self.models = list(models)
        self.trials_per_model = trials_per_model
        self.fixed = fixed
        self.studies = {
            model: ModelStudy(domains, seed=seed + i, mode=modes, n_startup_trials=n_startup_trials)
            for i, model in enumerate(self.models)
        }
        self.proposed = {model: 0 for model in self.models}
        self.exhausted: set[str] = set()
        self.owner: dict[str, tuple[str, dict]] = {}

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True  # the studies were built with their space, metric and mode

    def suggest(self, trial_id: str):
        while True:
            waiting = [m for m in self.models if self.proposed[m] < self.trials_per_model and m not in self.exhausted]
            if not waiting:
                return Searcher.FINISHED
            model = min(waiting, key=lambda m: self.proposed[m])
            params = self.studies[model].ask()
            if params is not None:
                break
            self.exhausted.add(model)
        self.proposed[model] += 1
        self.owner[trial_id] = (model, params)
        return {**params, "model": model, "seed": 0, "fixed": self.fixed}

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id not in self.owner:
            return
        model, params = self.owner.pop(trial_id)
        metrics = [m for m, _ in getattr(self, "objectives", ((self.metric, self.mode),))]  # restored older state
        usable = not error and result is not None and all(isinstance(result.get(m), (int, float)) for m in metrics)
        self.studies[model].tell(params, tuple(float(result[m]) for m in metrics) if usable else None)

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__dict__.copy(), f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))
