"""The sweep's console: one line per trial that ends (finished, stopped early, or errored) and a status line at
most every `interval_s` seconds. Tune's own tables (a config table per trial start, a result table per report:
~100 lines a trial) come back with `taylor-tune -v sweep`. A local storage that fills up during the sweep ends it
(`FullStorage`), and the CLI says so in one line."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import TextIO

from ray.tune import Callback

from taylor_tune.schema import SEARCHABLE
from taylor_tune.storage.location import storage_full

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
    """model method seq_len samples: ppl, acc_mean, measured decode speedup (with its paired 95% interval), seconds;
    and how far it got when it did not finish."""
    ppl, acc, speedup = result.get("ppl"), result.get("acc_mean"), result.get("decode_speedup")
    low, high = result.get("decode_speedup_low"), result.get("decode_speedup_high")
    interval = f" [{low:.2f}, {high:.2f}]" if all(isinstance(v, (int, float)) for v in (low, high)) else ""
    parts = [f"ppl {ppl:.2f}" if isinstance(ppl, (int, float)) else "ppl –",
             f"acc_mean {acc:.4f}" if isinstance(acc, (int, float)) else "acc_mean –",
             *([f"decode {speedup:.2f}x{interval}"] if isinstance(speedup, (int, float)) else []),
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


class FullStorage(Callback):
    """Watches a local storage during the sweep (at most every `every_s`, at Tune's steps). Once it is full
    (`location.storage_full`), the sweep is ended as Ctrl-C ends it, once: Tune saves what it can and returns, the
    trials not finished stay pending for the rerun, and no pending trial is started only to fail on the same disk."""

    def __init__(self, storage_path: str, *, every_s: float = 1.0, clock=time.monotonic,
                 is_full: Callable[[str], str | None] = storage_full):
        self.storage_path, self.every_s, self.clock, self.is_full = storage_path, every_s, clock, is_full
        self.checked = float("-inf")
        self.full = False

    def on_step_begin(self, iteration, trials, **info) -> None:
        if self.full or self.clock() - self.checked < self.every_s:
            return
        self.checked = self.clock()
        if self.is_full(self.storage_path) is not None:
            self.full = True
            self.stop()

    def stop(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)


class QuietWhenFull(logging.Filter):
    """On Ray's log handlers during a sweep: once the local storage is full, Ray's own records are dropped (each
    would be a traceback saying that a write failed: hundreds in a sweep); the CLI says it in one line
    (`cli._run_sweep`). The storage is looked at for each record at WARNING or above until it is full."""

    def __init__(self, storage_path: str, is_full: Callable[[str], str | None] = storage_full):
        super().__init__()
        self.storage_path, self.is_full, self.full = storage_path, is_full, False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.full and record.levelno >= logging.WARNING:
            self.full = self.is_full(self.storage_path) is not None
        return not self.full


@contextmanager
def quiet_when_full(storage_path: str):
    """QuietWhenFull on the handlers of Ray's logger for the duration."""
    quiet, handlers = QuietWhenFull(storage_path), list(logging.getLogger("ray").handlers)
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        yield quiet
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)


class ConsoleCallback(Callback):
    def __init__(self, final_stage: str, *, interval_s: float = 30, out: TextIO | None = None, clock=time.monotonic,
                 storage: str | None = None, total: int = 0, is_full: Callable[[str], str | None] = storage_full):
        self.final_stage, self.interval_s, self.out, self.clock = final_stage, interval_s, out, clock
        self.total = total  # the trials the search will run: Tune creates them lazily (one at a time when limited)
        # once it is full, a trial's error is the disk's, said once by the CLI: no errored line, no status count
        self.storage, self.is_full = storage, is_full
        self.last_status = clock()
        self.ended = 0

    def _print(self, line: str) -> None:
        print(line, file=self.out or sys.stdout, flush=True)

    def _full(self) -> bool:
        return self.storage is not None and self.is_full(self.storage) is not None

    def _of(self, trials) -> int:
        return max(len(trials), self.total)

    def _count(self, trials) -> str:
        return f"[{self.ended}/{self._of(trials)}]"

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self.ended += 1
        self._print(f"{self._count(trials)} {trial_line(trial.config, trial.last_result or {}, self.final_stage)}")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self.ended += 1
        if self._full():
            return
        try:
            error = error_summary(trial.get_error())
        except Exception as failure:  # the error file is Tune's; never let reading it take the sweep down
            error = f"(error text unreadable: {type(failure).__name__})"
        self._print(f"{self._count(trials)} {trial_name(trial.config)}: errored: {error}")

    def on_step_end(self, iteration, trials, **info) -> None:
        if self.clock() - self.last_status < self.interval_s:
            return
        self.last_status = self.clock()
        if self._full():
            return
        states: dict[str, int] = {}
        for trial in trials:
            states[trial.status] = states.get(trial.status, 0) + 1
        self._print(
            f"{time.strftime('%H:%M:%S')} {states.get('TERMINATED', 0)} finished, {states.get('RUNNING', 0)} running, "
            f"{states.get('PENDING', 0)} pending, {states.get('ERROR', 0)} errored, of {self._of(trials)}"
        )
