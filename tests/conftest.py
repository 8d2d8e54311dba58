"""Shared fixtures: the real offline world's assets, the three tiny architectures, and the gpu marker."""

import gc
import os
from pathlib import Path

# No test may reach the hub: fail fast instead of waiting on timeouts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

from taylor_tune.sources.assets import ASSETS, asset_dir, fetch, home, require
from tests.helpers import ARCHS, FAST_ARCHS

# The longest modules first (their seconds in a clean `make test`, BENCHMARKS.md), the rest in collection order:
# pytest-xdist's loadscope hands the modules out in that order under `--no-loadscope-reorder` (the Makefile's), so a
# long module does not start last and run alone on one worker while the other idles. (Its default order, most tests
# first, put the Ray sweeps, a few long tests each, at the end.)
LONGEST_FIRST = (
    "tests/sweep/test_sweep_resilience.py", "tests/sources/test_real_world.py", "tests/test_object_storage.py",
    "tests/test_cluster.py", "tests/sweep/test_smoke_sweep.py",
    "tests/sweep/test_search_sweeps.py", "tests/recovery/test_recovery_sweeps.py", "tests/sweep/test_memory.py",
    "tests/evaluation/test_requests.py", "tests/sources/test_assets.py", "tests/test_storage_full.py",
    "tests/test_bench_gpu.py", "tests/evaluation/test_scorer.py", "tests/sweep/test_baseline_sweep.py",
    "tests/sweep/test_depth_sweep.py", "tests/test_folder_edit_property.py",
)


# Before the `-m` selection (tryfirst): a test that asks for the run's Ray head is a Ray sweep, so it is slow, and
# the quick tier (`make test-fast`) starts no Ray cluster without each such test having to say so.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    import torch  # here, not at the top: pytest-xdist's controller loads this file and needs no torch

    for item in items:
        if "ray_head" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order

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


@pytest.fixture(params=[a if a in FAST_ARCHS else pytest.param(a, marks=pytest.mark.slow) for a in ARCHS])
def arch(request) -> str:
    return request.param


def _this_run(tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this run shares (and no other run): the run's id under the workers'
    common parent, or the base folder itself without xdist."""
    base = tmp_path_factory.getbasetemp()
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    shared = base.parent / f"run-{run}" if run else base / "run"
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict:
    """The real offline world (every asset of `ASSETS`), fetched into $TAYLOR_TUNE_HOME when missing: the one way a
    test gets a fetched asset, so no test depends on another having fetched it first (CI runs from an empty home).
    Each asset this run downloads is recorded (its folder), for `fetched_from_empty`."""
    records = _this_run(tmp_path_factory)
    for name in ASSETS:
        if fetch(name, log=lambda line: None)["downloaded"]:
            (records / f"downloaded-{name}").write_text(str(asset_dir(name)))
    return {name: require(name) for name in ASSETS}


@pytest.fixture
def fetched_from_empty(assets, tmp_path_factory) -> Path | None:
    """$TAYLOR_TUNE_HOME when this run fetched every asset into it (CI: an empty home, so the session's fetch was a
    fetch from an empty cache, by whichever worker came first), else None: the fetch test then fetches into an empty
    home of its own rather than doing the same 100 s of downloads and conversions a second time."""
    records = _this_run(tmp_path_factory)
    downloaded = {name: records / f"downloaded-{name}" for name in ASSETS}
    if all(r.is_file() and r.read_text() == str(asset_dir(name)) for name, r in downloaded.items()):
        return home()
    return None


@pytest.fixture(scope="session")
def ray_head() -> str:
    """The run's Ray head (`sweep_helpers.shared_head`), for the sweeps that only read their results:
    `run_sweep(..., cluster=ray_head)`."""
    from tests.sweep_helpers import shared_head

    return shared_head()


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controlling process stops the head once every worker is done
    from tests.sweep_helpers import stop_head

    stop_head()
