"""lm-eval 0.4.13's private names: the task YAML loader, the HFLM internals the prefix scorer builds on (it
overrides `_loglikelihood_tokens` and reads the attributes HFLM's own version reads), and the environment record
`simple_evaluate` adds to every result."""

from __future__ import annotations

from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

from taylor_tune.compat import missing

TESTED = "0.4.13"
HFLM_METHODS = ("_loglikelihood_tokens", "_model_call")
HFLM_ATTRIBUTES = ("backend", "mixed_precision_dtype", "softmax_dtype", "cache_hook", "rank", "max_length", "device")
ENVIRONMENT_RECORD = ("get_git_commit_hash", "add_env_info")  # names in lm_eval.evaluator


def _versions_only(results: dict) -> None:
    results.update(lm_eval_version=version("lm_eval"), transformers_version=version("transformers"))


@contextmanager
def without_environment_record():
    """Inside, `simple_evaluate` records only lm-eval's and transformers' versions with its results. Its own record
    runs `git describe` in the working directory (which prints `fatal: not a git repository` into every trial's log
    outside a checkout, as under `ray job submit --working-dir`) and torch's `collect_env`, which starts a dozen
    processes (pip, nvidia-smi, ...) on every call; nothing here reads either."""
    from lm_eval import evaluator

    saved = {name: getattr(evaluator, name) for name in ENVIRONMENT_RECORD}
    evaluator.get_git_commit_hash, evaluator.add_env_info = (lambda: None), _versions_only
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(evaluator, name, value)


def load_task_yaml(path: Path) -> dict:
    """A registered task's YAML with its `!function` entries resolved, as lm-eval's TaskManager reads it."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return dict(load_yaml(path, resolve_func=True))


def check(lm=None) -> None:
    """Raise CompatError if a fenced name is gone; `lm`: an HFLM instance, to check its attributes too."""
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM

    gone = [f"HFLM.{name}" for name in HFLM_METHODS if not callable(vars(HFLM).get(name))]  # HFLM's own, not a base's
    gone += [f"lm_eval.evaluator.{name}" for name in ENVIRONMENT_RECORD if not callable(getattr(evaluator, name, None))]
    try:
        from lm_eval.tasks._yaml_loader import load_yaml  # noqa: F401
    except ImportError:
        gone.append("lm_eval.tasks._yaml_loader.load_yaml")
    if lm is not None:
        gone += [f"HFLM().{name}" for name in HFLM_ATTRIBUTES if not hasattr(lm, name)]
    missing("lm-eval", TESTED, gone)
