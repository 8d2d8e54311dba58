"""Issue 91, case 9: every service a test starts listens on loopback only. The suite's shared Ray head was started by
`ray start --node-ip-address=127.0.0.1`, which turns that address into the machine's: its client server, GCS, raylet
and agents listened on the machine's interface address and on every interface (seen: 0.0.0.0, ::, 192.0.2.2)."""

import pytest

from tests.sweep_helpers import HEAD_TEMP, listeners, ray_processes

pytestmark = pytest.mark.slow  # starts the run's Ray head when no test before it has

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def test_the_suites_shared_head_listens_on_loopback_only(ray_head):
    found = listeners(ray_processes(0, HEAD_TEMP))
    names = {name for _, _, name in found}
    assert {"gcs_server", "raylet"} <= names, found  # the head's own servers were found, and looked at
    assert [entry for entry in found if entry[0] not in LOOPBACK] == [], found
    assert ray_head.startswith("127.0.0.1:")
