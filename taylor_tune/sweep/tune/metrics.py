"""A sweep's custom Ray metrics (`ray.util.metrics`), scraped by Prometheus from each node's metrics agent.

Driver side, `SweepMetricsCallback` (a Tune callback): trials by state and the best value of the sweep's metric
so far per model (`taylor_tune_best{metric, mode}`: acc_mean / max, or ppl / min for a perplexity sweep). Trial side,
`TrialMetrics` (fed every report of a trial): stage durations, importance-cache events
and the trial's peak GPU memory. Ray prefixes every name with `ray_`; dashboards/taylor_tune.json queries
them. Metric objects are made on first use (Ray must be running), never at import time.
"""

from __future__ import annotations

import functools
import os
import time

from ray.tune import Callback

from taylor_tune.schema import stage_seconds

STATES = {"PENDING": "pending", "RUNNING": "running", "TERMINATED": "finished", "ERROR": "errored", "PAUSED": "paused"}


@functools.cache
def _metrics() -> dict:
    from ray.util.metrics import Counter, Gauge

    return {
        "trials": Gauge("taylor_tune_trials", "Trials of the sweep in each state", tag_keys=("experiment", "state")),
        "best": Gauge(
            "taylor_tune_best",
            "Best value of the sweep's metric so far (final evaluation) per model",
            tag_keys=("experiment", "model", "metric", "mode"),
        ),
        # two counters rather than a histogram: Ray exports a histogram's sum from bucket midpoints, and the
        # dashboard's mean stage time (seconds / runs) should be exact
        "stage_seconds": Counter(
            "taylor_tune_stage_seconds",
            "Seconds trials spent in each stage, summed",
            tag_keys=("experiment", "model", "stage"),
        ),
        "stage_runs": Counter(
            "taylor_tune_stage_runs", "Trials that completed each stage", tag_keys=("experiment", "model", "stage")
        ),
        "cache": Counter(
            "taylor_tune_importance_cache_events",
            "Importance-cache lookups: hit, computed (a miss) or takeover",
            tag_keys=("experiment", "event"),
        ),
        "gpu": Gauge(
            "taylor_tune_trial_peak_gpu_memory_bytes",
            "Peak GPU memory of a trial (pruning + evaluation)",
            tag_keys=("experiment", "model", "trial"),
        ),
    }


def tags(**values: str) -> dict[str, str]:
    """Tag values as Ray takes them: ASCII only (Ray refuses any other character, and a model path such as
    /data/modèle is a tag), other characters escaped as Python writes them (\\xe8), so every value stays distinct."""
    return {key: str(value).encode("ascii", "backslashreplace").decode("ascii") for key, value in values.items()}


class TrialMetrics:
    """Emits what a trial's reports newly contain: each stage's duration once, the cache event once, the peak."""

    def __init__(self, experiment: str, model: str, trial: str):
        self.tags = tags(experiment=experiment, model=model)
        self.trial = tags(trial=trial)["trial"]
        self.seen: set[str] = set()

    def observe(self, metrics: dict) -> None:
        m = _metrics()
        for stage, seconds in stage_seconds(metrics).items():
            if stage not in self.seen and seconds > 0:  # Ray's Counter takes positive increments only
                self.seen.add(stage)
                m["stage_seconds"].inc(float(seconds), tags={**self.tags, **tags(stage=stage)})
                m["stage_runs"].inc(1, tags={**self.tags, **tags(stage=stage)})
        event = metrics.get("importance_cache")
        if event and "cache" not in self.seen:
            self.seen.add("cache")
            m["cache"].inc(1, tags={"experiment": self.tags["experiment"], **tags(event=event)})
        if isinstance(metrics.get("peak_gpu_memory_bytes"), (int, float)):
            m["gpu"].set(float(metrics["peak_gpu_memory_bytes"]), tags={**self.tags, "trial": self.trial})


class SweepMetricsCallback(Callback):
    """Trial counts by state after every step of the Tune loop, and the best final metric per model (by `mode`).

    At the end it waits `flush_s` seconds so that the final values reach the node's metrics agent before the
    driver exits (Ray exports every `metrics_report_interval_ms`, 10 s by default)."""

    def __init__(
        self,
        experiment: str,
        final_stage: str,
        metric: str = "acc_mean",
        mode: str = "max",
        flush_s: float | None = None,
    ):
        self.experiment, self.final_stage, self.metric, self.mode = experiment, final_stage, metric, mode
        self.sign = 1 if mode == "max" else -1
        default = "12" if os.environ.get("RAY_ADDRESS") else "0"  # on a cluster someone is watching; locally no agent
        self.flush_s = float(os.environ.get("TAYLOR_TUNE_METRICS_FLUSH_S", default)) if flush_s is None else flush_s
        self.best: dict[str, float] = {}

    def _counts(self, trials) -> None:
        counts = dict.fromkeys(STATES.values(), 0)
        for trial in trials:
            counts[STATES.get(trial.status, "pending")] += 1
        for state, n in counts.items():
            _metrics()["trials"].set(n, tags=tags(experiment=self.experiment, state=state))

    def on_step_end(self, iteration, trials, **info) -> None:
        self._counts(trials)

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        model, value = result.get("model"), result.get(self.metric)
        if result.get("stage") == self.final_stage and model and isinstance(value, (int, float)):
            if model not in self.best or self.sign * value > self.sign * self.best[model]:
                self.best[model] = float(value)
                _metrics()["best"].set(float(value), tags=tags(experiment=self.experiment, model=model,
                                                               metric=self.metric, mode=self.mode))

    def on_experiment_end(self, trials, **info) -> None:
        self._counts(trials)
        if self.flush_s > 0:
            time.sleep(self.flush_s)
