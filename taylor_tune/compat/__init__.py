"""Every use of a dependency's private API, one module per dependency, each name checked by `check()`.

The versions are pinned (pyproject.toml); when an upgrade moves a fenced name, `check()` and its test fail with
a message naming it, instead of a sweep failing somewhere inside a trial.
"""

from taylor_tune.errors import TaylorTuneError


class CompatError(TaylorTuneError):
    """A pinned dependency no longer has a private name taylor_tune relies on."""


def missing(package: str, tested: str, names: list[str]) -> None:
    if names:
        raise CompatError(f"{package}: {', '.join(names)} no longer exist(s); taylor_tune is tested with {package} "
                          f"{tested} (pinned in pyproject.toml): adapt taylor_tune/compat/ before upgrading")
