"""Fault injection for the sweep tests, from outside the product: a test puts this folder on PYTHONPATH, so every
Python process of the sweep (the driver and Ray's workers) runs this file at start-up.

With TAYLOR_TUNE_TEST_FAULT='{"pruning_method": "blockwise", ...}' a trial whose configuration matches raises
InjectedFault before it prunes. With TAYLOR_TUNE_TEST_PAUSE=<folder> a trial, once its final report is made, touches
<folder>/<trial id> and sleeps: a window in which a test kills the sweep. With TAYLOR_TUNE_TEST_FILL=<file> the first
trial to finish fills the disk that <file> is on (writes <file> until no space is left): the storage fills mid-sweep.
With TAYLOR_TUNE_TEST_SLOW=<seconds> every trial first sleeps that long: a sweep slow enough to be interrupted part-way
whatever the machine. With TAYLOR_TUNE_TEST_SLOW_PASS=<seconds> every importance pass a trial computes (under the
cache's lease) first sleeps that long: a window in which a test removes the node that holds the lease. Without any of
them nothing happens. With TAYLOR_TUNE_TEST_SWALLOW=1 the driver's start records an interrupt that nothing raises (what
an extension module's initialisation does to one it prints as "Exception ignored").
The product's modules are patched when they are first imported (nothing is imported here ahead of time).
"""

import functools
import importlib.abc
import importlib.util
import json
import os
import sys
import time
from pathlib import Path


class InjectedFault(RuntimeError):
    """Raised on purpose by the sweep tests."""


def _fail_matching(run_trial):
    fault = json.loads(os.environ["TAYLOR_TUNE_TEST_FAULT"])

    @functools.wraps(run_trial)
    def wrapper(trial, *args, **kwargs):
        from taylor_tune.sweep.trial import trial_columns

        if all(trial_columns(trial.prune).get(k) == v for k, v in fault.items()):
            raise InjectedFault(f"injected fault for {fault}")
        return run_trial(trial, *args, **kwargs)

    return wrapper


def _slow(run_trial):
    seconds = float(os.environ["TAYLOR_TUNE_TEST_SLOW"])

    @functools.wraps(run_trial)
    def wrapper(*args, **kwargs):
        time.sleep(seconds)
        return run_trial(*args, **kwargs)

    return wrapper


def _pause_after(trainable):
    folder = os.environ["TAYLOR_TUNE_TEST_PAUSE"]

    @functools.wraps(trainable)
    def wrapper(config):
        from ray import tune

        trainable(config)
        Path(folder, tune.get_context().get_trial_id()).touch()
        time.sleep(600)

    return wrapper


def _fill_disk_after(trainable):
    filler = Path(os.environ["TAYLOR_TUNE_TEST_FILL"])

    @functools.wraps(trainable)
    def wrapper(config):
        trainable(config)
        try:
            with open(filler, "xb") as handle:  # once: the first trial to finish
                while True:
                    handle.write(b"\0" * (1 << 20))
                    handle.flush()
        except FileExistsError:
            pass
        except OSError:  # no space left: the disk is full now
            pass

    return wrapper


def _slow_pass(get_or_compute):
    seconds = float(os.environ["TAYLOR_TUNE_TEST_SLOW_PASS"])

    @functools.wraps(get_or_compute)
    def wrapper(self, fields, counts, compute, *args, **kwargs):
        def slow():
            time.sleep(seconds)
            return compute()

        return get_or_compute(self, fields, counts, slow, *args, **kwargs)

    return wrapper


def _swallowed_interrupt(validate):
    """The start's checks, then an interrupt recorded and lost, as an extension module's start loses one."""
    @functools.wraps(validate)
    def wrapper(*args, **kwargs):
        out = validate(*args, **kwargs)
        from taylor_tune import cli

        cli._SIGNALLED.append(15)
        return out
    return wrapper


PATCHES = {}  # module -> (attribute, wrapper factory); "Class.method" patches a class's method
if os.environ.get("TAYLOR_TUNE_TEST_FAULT"):
    PATCHES["taylor_tune.sweep.trial"] = ("run_trial", _fail_matching)
if os.environ.get("TAYLOR_TUNE_TEST_SLOW"):
    PATCHES["taylor_tune.sweep.trial"] = ("run_trial", _slow)
if os.environ.get("TAYLOR_TUNE_TEST_PAUSE"):
    PATCHES["taylor_tune.sweep.tune.trainable"] = ("sweep_trainable", _pause_after)
if os.environ.get("TAYLOR_TUNE_TEST_SLOW_PASS"):
    PATCHES["taylor_tune.pruning.importance_cache"] = ("ImportanceCache.get_or_compute", _slow_pass)
if os.environ.get("TAYLOR_TUNE_TEST_FILL"):
    PATCHES["taylor_tune.sweep.tune.trainable"] = ("sweep_trainable", _fill_disk_after)
if os.environ.get("TAYLOR_TUNE_TEST_SWALLOW"):
    PATCHES["taylor_tune.sweep.tune.driver"] = ("validate", _swallowed_interrupt)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in PATCHES:
            return None
        sys.meta_path.remove(self)  # let the ordinary finders find it
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        original = spec.loader.exec_module
        attribute, factory = PATCHES[fullname]

        def exec_module(module):
            original(module)
            owner, _, name = attribute.rpartition(".")
            target = getattr(module, owner) if owner else module
            setattr(target, name, factory(getattr(target, name)))

        spec.loader.exec_module = exec_module
        return spec


if PATCHES:
    sys.meta_path.insert(0, _PatchAfterImport())
