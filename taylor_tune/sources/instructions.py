"""Instruction data for recovery fine-tuning: Alpaca-style records (`instruction`, optional `input`, `output`) from
the hub's `yahma/alpaca-cleaned` (LLM-Pruner's recovery set) through `datasets`, or from a local `.json` (a list of
records) or `.jsonl` file in the same schema. Each record becomes the Alpaca prompt and its response, and the
recovery's loss is taken on the response only (LLM-Pruner's recipe). Reads files; must not import torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from taylor_tune.errors import CalibrationError, ConfigError
from taylor_tune.sources.data import DatasetSource

INSTRUCTION_DATASETS = {"alpaca": DatasetSource(path="yahma/alpaca-cleaned", split="train")}
INSTRUCTION_SUFFIXES = (".json", ".jsonl")
FIELDS = ("instruction", "output")  # required; `input` may be missing or empty

# The Alpaca template (tatsu-lab/stanford_alpaca; LLM-Pruner's and alpaca-lora's `alpaca` template).
PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
          "Write a response that appropriately completes the request.\n\n"
          "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


def is_instruction_data(name: str) -> bool:
    return name in INSTRUCTION_DATASETS or Path(name).suffix in INSTRUCTION_SUFFIXES


def prompt_and_response(record: dict) -> tuple[str, str]:
    """The Alpaca prompt of a record (with its input when it has one) and the response the loss is taken on."""
    given = (record.get("input") or "").strip()
    template = PROMPT if given else PROMPT_NO_INPUT
    return template.format(instruction=record["instruction"], input=given), record["output"]


def _checked(records: list, where: str) -> list[dict]:
    if not records:
        raise ConfigError(f"{where}: holds no records")
    for i, record in enumerate(records):
        if not isinstance(record, dict) or any(not isinstance(record.get(f), str) for f in FIELDS):
            raise ConfigError(f"{where}: record {i} is not an Alpaca record (text fields instruction and output, "
                              "optional input)")
    return records


def _read_file(path: Path, where: str) -> list:
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        return json.loads(text)
    except OSError as error:
        raise ConfigError(f"{where}: cannot read {path}: {error.strerror}") from None
    except (UnicodeDecodeError, ValueError):
        raise ConfigError(f"{where}: {path} is not UTF-8 JSON{' lines' if path.suffix == '.jsonl' else ''}") \
            from None


def load_instructions(source: str | DatasetSource, where: str = "recovery.data") -> list[dict]:
    """Every record of an instruction data set: a name of INSTRUCTION_DATASETS or a DatasetSource (through
    `datasets.load_dataset`), or a local .json / .jsonl file."""
    if isinstance(source, str) and source not in INSTRUCTION_DATASETS:
        return _checked(_read_file(Path(source), where), where)
    import datasets  # slow to import, and only the hub's data sets need it

    source = INSTRUCTION_DATASETS[source] if isinstance(source, str) else source
    try:
        data = datasets.load_dataset(source.path, source.name, split=source.split, data_files=source.data_files,
                                     **source.kwargs)
    except Exception as error:  # datasets raises many kinds (ConnectionError, FileNotFoundError, ...)
        raise CalibrationError(f"{where}: cannot load dataset {source.path!r}: {type(error).__name__}: "
                               f"{str(error).splitlines()[0]}") from None
    missing = [f for f in FIELDS if f not in data.column_names]
    if missing:
        raise CalibrationError(f"{where}: dataset {source.path!r} has no column {missing[0]!r}")
    return _checked(list(data), where)


def check_instruction_file(name: str, where: str = "recovery.data") -> None:
    """A local instruction file exists and holds Alpaca records (read whole: such files are tens of MB at most)."""
    if name in INSTRUCTION_DATASETS:
        return
    path = Path(name)
    if not path.is_file():
        raise ConfigError(f"{where}: {name!r} is neither an instruction dataset "
                          f"({', '.join(INSTRUCTION_DATASETS)}) nor an existing .json / .jsonl file")
    _checked(_read_file(path, where), where)
