"""The sweep's console: one line per trial that ends (finished, stopped early, or errored) and a status line at
most every `interval_s` seconds. Tune's own tables (a config table per trial start, a result table per report:
~100 lines a trial) come back with `taylor-tune -v sweep`."""

from __future__ import annotations

import re
import sys
import time
from typing import TextIO

from ray.tune import Callback

from taylor_tune.schema import SEARCHABLE

# how the console names the paper's three dimensions; any other searched one goes by its own name
_SHORT = {"taylor_seq_len": "seq_len", "taylor_num_samples": "samples"}


def trial_name(config: dict) -> str:
    """The model and the trial's searched settings: `tiny-llama taylor seq_len=16 samples=8 sparsity=0.3`."""
    method = f" {config['pruning_method']}" if "pruning_method" in config else ""
    searched = " ".join(f"{_SHORT.get(name, name)}={config[name]}" for name in SEARCHABLE
                        if name in config and name != "pruning_method")
    seed = f" seed={config['seed']}" if config.get("seed") else ""
    return f"{config.get('model')}{method}{' ' + searched if searched else ''}{seed}"


def trial_line(config: dict, result: dict, final_stage: str) -> str:
    """model method seq_len samples: ppl, acc_mean, measured decode speedup, seconds; and how far it got when it did
    not finish."""
    ppl, acc, speedup = result.get("ppl"), result.get("acc_mean"), result.get("decode_speedup")
    parts = [f"ppl {ppl:.2f}" if isinstance(ppl, (int, float)) else "ppl –",
             f"acc_mean {acc:.4f}" if isinstance(acc, (int, float)) else "acc_mean –",
             *([f"decode {speedup:.2f}x"] if isinstance(speedup, (int, float)) else []),
             f"{result.get('time_total_s', 0):.0f} s"]
    stage = result.get("stage")
    if stage and stage != final_stage:
        parts.append(f"stopped after {stage}")
    return f"{trial_name(config)}: " + ", ".join(parts)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # Ray colours the task names in its error traces


def error_summary(text: str | None) -> str:
    """The exception line of a Tune error trace (its last non-blank line), without terminal colour codes."""
    lines = [line for line in _ANSI.sub("", text or "").splitlines() if line.strip()]
    return lines[-1].strip()[:200] if lines else "no error text"


class ConsoleCallback(Callback):
    def __init__(self, final_stage: str, *, interval_s: float = 30, out: TextIO | None = None, clock=time.monotonic):
        self.final_stage, self.interval_s, self.out, self.clock = final_stage, interval_s, out, clock
        self.last_status = clock()
        self.ended = 0

    def _print(self, line: str) -> None:
        print(line, file=self.out or sys.stdout, flush=True)

    def _count(self, trials) -> str:
        return f"[{self.ended}/{len(trials)}]"

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self.ended += 1
        self._print(f"{self._count(trials)} {trial_line(trial.config, trial.last_result or {}, self.final_stage)}")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self.ended += 1
        try:
            error = error_summary(trial.get_error())
        except Exception as failure:  # the error file is Tune's; never let reading it take the sweep down
            error = f"(error text unreadable: {type(failure).__name__})"
        self._print(f"{self._count(trials)} {trial_name(trial.config)}: errored: {error}")

    def on_step_end(self, iteration, trials, **info) -> None:
        if self.clock() - self.last_status < self.interval_s:
            return
        self.last_status = self.clock()
        states: dict[str, int] = {}
        for trial in trials:
            states[trial.status] = states.get(trial.status, 0) + 1
        self._print(
            f"{time.strftime('%H:%M:%S')} {states.get('TERMINATED', 0)} finished, {states.get('RUNNING', 0)} running, "
            f"{states.get('PENDING', 0)} pending, {states.get('ERROR', 0)} errored, of {len(trials)}"
        )
