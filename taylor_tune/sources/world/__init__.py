"""The offline world: a small synthetic world whose text, tasks and tiny trained models ship with the package.

Nothing can be downloaded on the project's machines, so the pipeline runs end to end here: a corpus written
from the world's facts, a tokenizer trained on it, held-out text for perplexity, mini versions of the seven
zero-shot tasks in the real datasets' schemas, and a tiny checkpoint of every family (sources.families) trained on the
corpus. `scripts/make_offline_world.py` regenerates all of it (`scripts/world/generate.py` holds the world
itself); the package carries only the result.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def world_dir() -> Path:
    return Path(str(resources.files("taylor_tune") / "data" / "world"))


def task_file(task: str) -> Path:
    return world_dir() / "tasks" / f"{task}.jsonl"


def heldout_path() -> Path:
    return world_dir() / "heldout.txt"


def corpus_path() -> Path:
    return world_dir() / "corpus.txt"


def model_dir(name: str) -> Path:
    return world_dir() / "models" / name
