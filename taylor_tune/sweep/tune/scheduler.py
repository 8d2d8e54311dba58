"""ASHA for the sweep: one rung per cheap zero-shot pass.

A trial reports after pruning, after the perplexity and after each zero-shot pass (`evaluation.fidelities`,
cheapest first). ASHA puts its rungs at grace_period * reduction_factor**k of its time attribute, so on
`training_iteration` they would fall wherever that geometry puts them rather than on the passes (a cheap pass
between two rungs is never one). Here the time attribute is the pass itself: the k-th zero-shot
pass (0-based, `zero_shot_pass` in its result) is at reduction_factor**k, so the rungs (1, rf, rf**2, ...)
are exactly the cheap passes and the last pass is the end. Results before the first pass carry no
`acc_mean` and are not scheduled.
"""

from __future__ import annotations

from ray.tune.schedulers import AsyncHyperBandScheduler

PASS = "zero_shot_pass"
TIME = "zero_shot_rung_t"


class FidelityASHA(AsyncHyperBandScheduler):
    def __init__(self, passes: int, *, reduction_factor: float = 2, metric: str | None = None, mode: str | None = None):
        super().__init__(
            time_attr=TIME,
            metric=metric,
            mode=mode,
            max_t=reduction_factor ** (passes - 1),
            grace_period=1,
            reduction_factor=reduction_factor,
        )
        self.rung_base = reduction_factor

    def _timed(self, result: dict | None) -> dict | None:
        if result is None or PASS not in result:
            return result
        return {**result, TIME: self.rung_base ** result[PASS]}

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        return super().on_trial_result(tune_controller, trial, self._timed(result))

    def on_trial_complete(self, tune_controller, trial, result: dict) -> None:
        super().on_trial_complete(tune_controller, trial, self._timed(result))
