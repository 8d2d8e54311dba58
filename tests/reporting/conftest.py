"""The synthetic trial table with known answers, and its report: built once per test module."""


import pytest

from taylor_tune.reporting import (
    build_report,
)
from tests.report_helpers import (
    synthetic_trials,
)


@pytest.fixture(scope="module")
def table():
    return synthetic_trials()


@pytest.fixture(scope="module")
def report(table):
    return build_report(table)
