"""Which data a name means: the one place where `auto`, `world`, `wiki`, `real`, `hub`, `sample` or a path becomes a
concrete source (a text file, a dataset, a folder of task files).

A model belongs to a world: "real" for the real offline models, "world" for the tiny built-ins, "hub" for
anything else (a pruned folder belongs to the world of the model it was pruned from). `auto` means that world's
data: its calibration and perplexity text (`WORLD_TEXT`) and its task data.
Reads files; must not import torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from taylor_tune.config import BUILTIN_TEXTS, CALIBRATION_DATASETS, PPL_DATASETS, TASK_DATA, EvalSpec
from taylor_tune.errors import CalibrationError, ConfigError, EvaluationError
from taylor_tune.sources import world
from taylor_tune.sources.assets import MODEL_ASSETS, asset_dir, require
from taylor_tune.sources.families import FAMILIES

# The built-in models (here, not in `models`, which needs torch): random-init ones by architecture, and the ones
# trained on the synthetic world. A pruned folder holds PRUNED_MANIFEST beside its HF files.
TINY_MODELS = {f"{family.tiny_name}-random": model_type for model_type, family in FAMILIES.items()}
TRAINED_MODELS = tuple(family.tiny_name for family in FAMILIES.values())
PRUNED_MANIFEST = "pruned_layout.json"

# The text of each world: what `calibration: auto` and `ppl: auto` mean for a model of that world.
WORLD_TEXT = {"real": "wiki", "world": "world", "hub": "wikitext2"}


@dataclass(frozen=True)
class DatasetSource:
    """Arguments of `datasets.load_dataset` plus the column that holds the text."""

    path: str
    name: str | None = None
    split: str = "train"
    data_files: dict[str, str] | None = None
    text_field: str = "text"
    kwargs: dict = field(default_factory=dict)


DATASETS = {
    "wikitext2": DatasetSource(path="wikitext", name="wikitext-2-raw-v1", split="train"),
    "c4": DatasetSource(
        path="allenai/c4", data_files={"train": "en/c4-train.00000-of-01024.json.gz"}, split="train"
    ),
}
WIKITEXT2_TEST = DatasetSource(path="wikitext", name="wikitext-2-raw-v1", split="test")


def world_of(spec: str) -> str:
    """The world whose data suits the model by default: real, world or hub."""
    if spec in MODEL_ASSETS:
        return "real"
    if spec in TINY_MODELS or spec in TRAINED_MODELS:
        return "world"
    manifest = Path(spec) / PRUNED_MANIFEST
    if manifest.is_file():
        return world_of(str(json.loads(manifest.read_text()).get("source_model", "")))
    return "hub"


def resolve_text(source: str, model: str | None) -> str:
    """`auto` -> the text of the model's world (wikitext2 when the model is unknown); anything else unchanged."""
    if source != "auto":
        return source
    return WORLD_TEXT[world_of(model) if model else "hub"]


def resolve_task_data(task_data: str, model: str | None) -> str:
    """`auto` -> the model's world (hub when the model is unknown); anything else unchanged."""
    if task_data != "auto":
        return task_data
    return world_of(model) if model else "hub"


def sample_text_path() -> Path:
    """The small English-like corpus shipped with the package (for demos and offline runs)."""
    return Path(str(resources.files("taylor_tune") / "data" / "sample_corpus.txt"))


def load_dataset_rows(source: DatasetSource, what: str = "calibration") -> list[str]:
    """Every row of the dataset's text column, empty ones included, through `datasets.load_dataset`."""
    import datasets  # slow to import, and only the hub's datasets need it

    try:
        data = datasets.load_dataset(
            source.path, source.name, split=source.split, data_files=source.data_files, **source.kwargs
        )
    except Exception as error:  # datasets raises many kinds (ConnectionError, FileNotFoundError, ...)
        raise CalibrationError(
            f"{what}: cannot load dataset {source.path!r}: {type(error).__name__}: {str(error).splitlines()[0]}"
        ) from None
    if source.text_field not in data.column_names:
        raise CalibrationError(f"{what}: dataset {source.path!r} has no column {source.text_field!r}")
    return list(data[source.text_field])


def calibration_source(name: str) -> Path | DatasetSource:
    """A resolved calibration name (not `auto`) -> the text file or dataset it means."""
    if name in DATASETS:
        return DATASETS[name]
    if name == "world":
        return world.corpus_path()
    if name == "wiki":
        return require("wiki") / "calibration.txt"
    if name == "sample":
        return sample_text_path()
    return Path(name)


def load_ppl_text(name: str) -> str:
    """A resolved perplexity name (not `auto`) -> the whole text."""
    if name == "wikitext2":
        return "\n\n".join(load_dataset_rows(WIKITEXT2_TEST, what="ppl"))
    if name == "world":
        path = world.heldout_path()
    elif name == "wiki":
        path = require("wiki") / "heldout.txt"
    else:
        path = Path(name)
    try:
        return path.read_text(encoding="utf-8")
    except OSError as error:
        raise EvaluationError(f"ppl: cannot read {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise EvaluationError(f"ppl: {path} is not a UTF-8 text file") from None


def task_file(task: str, task_data: str) -> Path | None:
    """The local jsonl file of a task under a resolved task_data (not `auto`); None for the hub's own dataset."""
    if task_data == "hub":
        return None
    if task_data == "world":
        path = world.task_file(task)
    elif task_data == "real":
        path = require("real") / f"{task}.jsonl"
    else:
        path = Path(task_data) / f"{task}.jsonl"
    if not path.is_file():
        raise EvaluationError(f"task {task}: data file {path} is missing")
    return path


# ---------------------------------------------------------------- existence checks (config validation reads no file)

def _fetched(name: str) -> None:
    if name in ("wiki", "real"):
        require(name)  # AssetError: one line naming the fetch command


def heldout_paths() -> list[Path]:
    """The held-out text files that perplexity scores: the synthetic world's and the real offline world's (whether
    fetched or not: a path is compared, nothing is read)."""
    return [world.heldout_path(), asset_dir("wiki") / "heldout.txt"]


def check_calibration(name: str) -> None:
    """A calibration name is a dataset, a built-in text (fetched, where it is an asset) or an existing file."""
    if name in CALIBRATION_DATASETS or name in BUILTIN_TEXTS:
        return _fetched(name)
    if not Path(name).is_file():
        raise ConfigError(f"calibration: {name!r} is neither a dataset "
                          f"({', '.join(CALIBRATION_DATASETS + BUILTIN_TEXTS)}) nor an existing text file")


def check_eval_sources(spec: EvalSpec) -> None:
    """The perplexity text and every task's data file exist (fetched, for the real offline world's)."""
    if spec.ppl is not None:
        if spec.ppl in PPL_DATASETS:
            _fetched(spec.ppl)
        elif not Path(spec.ppl).is_file():
            raise ConfigError(
                f"ppl: {spec.ppl!r} is neither {', '.join(PPL_DATASETS)}, none, nor an existing text file"
            )
    if not spec.tasks:
        return
    if spec.task_data in TASK_DATA:
        return _fetched(spec.task_data)
    if not Path(spec.task_data).is_dir():
        raise ConfigError(f"task_data: {spec.task_data!r} is neither {', '.join(TASK_DATA)} nor an existing folder")
    missing = [t for t in spec.tasks if not (Path(spec.task_data) / f"{t}.jsonl").is_file()]
    if missing:
        raise ConfigError(f"task_data: {spec.task_data} has no {missing[0]}.jsonl")
