"""Shared fixtures: the real offline world's assets, the three tiny architectures, and the gpu marker."""

import gc
import os

# No test may reach the hub: fail fast instead of waiting on timeouts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

from taylor_tune.sources.assets import ASSETS, fetch, require
from tests.helpers import ARCHS


def pytest_collection_modifyitems(config, items):
    import torch  # here, not at the top: pytest-xdist's controller loads this file and needs no torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Every module a session imports (torch, transformers, lm-eval) lives until the process ends, yet each full collection
# of the garbage collector walks all of it again: during collection, during the tests, and at exit, where the run waits
# for each xdist worker's finalization (BENCHMARKS.md). Frozen objects are skipped by the collector (gc.freeze); what
# the tests themselves make is still collected.
def pytest_collectreport(report):
    gc.freeze()


def pytest_unconfigure(config):
    gc.freeze()


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def assets() -> dict:
    """The real offline world (every asset of `ASSETS`), fetched into $TAYLOR_TUNE_HOME when missing: the one way a
    test gets a fetched asset, so no test depends on another having fetched it first (CI runs from an empty home)."""
    for name in ASSETS:
        fetch(name, log=lambda line: None)
    return {name: require(name) for name in ASSETS}
