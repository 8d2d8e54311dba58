"""ASHA for the sweep: one rung per point of the recovery's held-out loss curve, then one per cheap zero-shot pass.

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
"""

from __future__ import annotations

from ray.tune.schedulers import AsyncHyperBandScheduler

from taylor_tune.schema import is_recovery_stage

PASS = "zero_shot_pass"
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
