"""A local sweep's trials run at the priority of the user who started it, not at Ray's lowered worker priority
(nice 15), which lets any CPU-bound process on the machine starve them (issue 62, must-show 5)."""

import subprocess
import sys

import pytest

from tests.sweep_helpers import env

PROBE = """
import os, ray
{start}
@ray.remote
def niceness():
    return os.nice(0)
print("niceness", ray.get(niceness.remote()))
ray.shutdown()
"""


def worker_niceness(start: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE.format(start=start)], capture_output=True, text=True,
                         timeout=300, env={**env(), "RAY_USAGE_STATS_ENABLED": "0"})
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split("niceness")[-1])


@pytest.mark.slow
def test_a_local_sweeps_workers_run_at_the_users_priority():
    own = worker_niceness("from taylor_tune.compat.ray import init_local\n"
                          "init_local(num_cpus=1, include_dashboard=False, logging_level='ERROR')")
    plain = worker_niceness("ray.init(address='local', num_cpus=1, include_dashboard=False, logging_level='ERROR')")
    assert (own, plain) == (0, 15)  # Ray's own default, which the sweep's start changes
