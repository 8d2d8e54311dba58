"""The sweep's schedulers: ASHA on the trials' own rungs (`FidelityASHA`), and racing on shared items
(`RaceScheduler`).

ASHA: one rung per point of the recovery's held-out loss curve, then one per cheap zero-shot pass.

A trial reports after pruning, at each point of its recovery's held-out loss curve (when it recovers), after the
perplexity and after each zero-shot pass (`evaluation.fidelities`, cheapest first). ASHA puts its rungs at
grace_period * reduction_factor**k of its time attribute, so on `training_iteration` they would fall wherever that
geometry puts them rather than on those points (a cheap pass between two rungs is never one). Here the time
attribute is the point itself: the k-th recovery point (1-based `recovery_point`) is at reduction_factor**(k-1), the
k-th zero-shot pass (0-based `zero_shot_pass`) at reduction_factor**(recovery_points + k), so the rungs are exactly
those points and the last pass is the end. At a recovery rung trials are compared by their held-out loss (lower is
better, whatever the sweep's metric; the metric is not measured yet), at a zero-shot rung by the sweep's metric.
Every trial's recovery reports its points at the same steps (`eval_every`), so a rung compares like with like; a
trial with fewer points (fewer steps searched) skips the later recovery rungs. Other results (pruned, speed, ppl)
carry neither and are not scheduled.

Racing: after each zero-shot pass (a block of the model's seeded items, `evaluation.item_seed`) the trial's per-item
outcomes are read from its folder in storage (the trainable puts them there before the report) and recorded in its
model's `racing.Race`, which says whether it goes on: a one-sided paired test against the incumbent on the items they
share, at `search.alpha`. A Ray Tune `TrialScheduler` rather than Optuna's WilcoxonPruner: the sweep's searcher is
its own per-model TPE or Tune's grid (neither is Tune's OptunaSearch, and that one never asks Optuna whether to
prune), the test is the report's task-stratified paired difference, not Wilcoxon's on items of different tasks, and
a grid sweep has no study at all. Tune saves neither scheduler's state; a race's is written to `names.RACE_FILE` in
the experiment folder after every decision, and a resumed driver's scheduler reads it (and each trial's outcomes,
checked against what the trial reported: `race_state`) back.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pandas as pd
from ray.tune.schedulers import AsyncHyperBandScheduler, FIFOScheduler, TrialScheduler

from taylor_tune.config import Evaluation
from taylor_tune.schema import is_recovery_stage
from taylor_tune.storage.folder import read_outcomes, read_ppl_windows, write_race
from taylor_tune.storage.location import open_location
from taylor_tune.sweep.race_state import RaceStateError, compared, item_scores, items_digest, read_race
from taylor_tune.sweep.racing import Decision, Race

log = logging.getLogger(__name__)

PASS = "zero_shot_pass"
PPL_PASS = "ppl_pass"
POINT = "recovery_point"
LOSS = "recovery_heldout_loss"
TIME = "zero_shot_rung_t"


class FidelityASHA(AsyncHyperBandScheduler):
    def __init__(self, passes: int, *, recovery_points: int = 0, reduction_factor: float = 2,
                 metric: str | None = None, mode: str | None = None):
        super().__init__(
            time_attr=TIME,
            metric=metric,
            mode=mode,
            max_t=reduction_factor ** (recovery_points + passes - 1),
            grace_period=1,
            reduction_factor=reduction_factor,
        )
        self.rung_base = reduction_factor
        self.recovery_points = recovery_points

    def _timed(self, result: dict | None) -> dict | None:
        if result is None:
            return result
        if PASS in result:
            return {**result, TIME: self.rung_base ** (self.recovery_points + result[PASS])}
        if self.recovery_points and is_recovery_stage(result.get("stage")) and POINT in result:
            loss = result[LOSS]  # as the sweep's metric in its direction: ASHA multiplies by its metric_op
            return {**result, TIME: self.rung_base ** (result[POINT] - 1),
                    self._metric: loss if self._mode == "min" else -loss}
        return result

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        return super().on_trial_result(tune_controller, trial, self._timed(result))

    def on_trial_complete(self, tune_controller, trial, result: dict) -> None:
        super().on_trial_complete(tune_controller, trial, self._timed(result))


class RaceScheduler(FIFOScheduler):
    """One `racing.Race` per model; stops a trial after a pass that its race says it lost: a zero-shot pass when the
    objective is acc_mean, a perplexity pass (its windows, `evaluation.ppl_fidelities`) when it is ppl. `location`:
    the experiment folder (local path or URI), where the trials' folders and the race's state live."""

    def __init__(self, location: str, alpha: float = 0.05, objective: str = "acc_mean"):
        super().__init__()
        self._supports_buffered_results = False  # a decision after every pass, not after a batch of them
        self.location, self.alpha, self.objective = location, alpha, objective
        self.key = PASS if objective == "acc_mean" else PPL_PASS
        self.races: dict[str, Race] = {}
        self.trials: dict[str, dict] = {}  # trial id -> model, block, stage, folder, metrics, final: race.json's
        self.loaded = False

    def _filesystem(self):
        return open_location(self.location)

    def _load(self) -> None:
        """After a resume: the races as their saved state left them, each trial's compared items read again from
        its folder and checked against what it reported (`race_state`; the driver checked them before Ray started,
        so a failure here is a file changed since: that trial is left out of the race, said in the log)."""
        self.loaded = True
        filesystem, root = self._filesystem()
        try:
            saved = read_race(filesystem, root)
        except RaceStateError as error:
            log.error("%s; the race starts again from the next results", error)
            return
        for trial_id, entry in (saved or {}).get("trials", {}).items():
            try:
                outcomes = compared(filesystem, root, trial_id, entry, self.objective)
            except RaceStateError as error:
                log.error("%s; left out of the race", error)
                continue
            race = self.races.setdefault(entry["model"], Race(self.alpha, self.objective))
            race.outcomes[trial_id] = outcomes
            self.trials[trial_id] = entry
        for model, decisions in (saved or {}).get("decisions", {}).items():
            race = self.races.setdefault(model, Race(self.alpha, self.objective))
            race.decisions = [Decision(**d) for d in decisions]

    def _save(self) -> None:
        filesystem, root = self._filesystem()
        state = {"alpha": self.alpha, "objective": self.objective, "trials": self.trials,
                 "decisions": {model: [dataclasses.asdict(d) for d in race.decisions]
                               for model, race in self.races.items()}}
        write_race(filesystem, root, json.dumps(state, indent=1).encode())

    def _outcomes(self, folder: str, stage: str, metrics: dict, filesystem) -> pd.Series | pd.DataFrame | None:
        """What the race compares: each item's score (acc_mean), or each window's NLL and tokens (ppl)."""
        if self.objective == "ppl":
            return read_ppl_windows(folder, filesystem)
        outcomes = read_outcomes(folder, stage, filesystem)
        return None if outcomes is None else item_scores(outcomes, metrics)

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        # a race on ppl decides after each perplexity pass only (the zero-shot passes' results carry its last index)
        if self.key not in result or (self.objective == "ppl" and not str(result.get("stage")).startswith("ppl")):
            return TrialScheduler.CONTINUE
        if not self.loaded:
            self._load()
        filesystem, _ = self._filesystem()
        evaluation = Evaluation.stored(trial.config["fixed"]["evaluation"])
        metrics = {task: evaluation.metric(task) for task in evaluation.tasks}
        outcomes = self._outcomes(result["output_dir"], result["stage"], metrics, filesystem)
        if outcomes is None:  # nothing to compare on (cannot happen with the trainable): never stop blind
            return TrialScheduler.CONTINUE
        model, block = trial.config["model"], result[self.key]
        race = self.races.setdefault(model, Race(self.alpha, self.objective))
        decision = race.record(trial.trial_id, block, outcomes)
        passes = evaluation.fidelities if self.objective == "acc_mean" else evaluation.ppl_fidelities
        final = block == len(passes) - 1  # the last pass ends the race for the trial: recorded, never "raced out"
        self.trials[trial.trial_id] = {"model": model, "block": block, "stage": result["stage"],
                                       "folder": result["output_dir"], "metrics": metrics, "items": len(outcomes),
                                       "sha256": items_digest(outcomes),  # what a resume checks them against
                                       "final": final, "stopped": not (decision.go_on or final),
                                       "why": decision.says(self.objective)}  # the report's line for a stopped trial
        self._save()
        return TrialScheduler.STOP if self.trials[trial.trial_id]["stopped"] else TrialScheduler.CONTINUE

    def debug_string(self) -> str:
        stopped = sum(entry["stopped"] for entry in self.trials.values())
        return (f"RaceScheduler: {self.objective} at alpha {self.alpha}, {len(self.trials)} trials raced, {stopped} "
                "stopped")

