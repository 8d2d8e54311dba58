"""Calibration sequences: `num_samples` windows of `seq_len` tokens from WikiText-2, C4 or a text file.

The draw is deterministic per seed and nested: documents are put in a seed-determined order, tokenized
one by one and concatenated (joined by "\\n\\n"), and sequence i is tokens [i*seq_len, (i+1)*seq_len) of
that stream. The stream does not depend on how many sequences are asked for, so the first n of a draw of
N > n are exactly the draw of n; only as many documents are tokenized as the draw needs.

WikiText-2 and C4 go through the real `datasets` loaders (as in LLM-Pruner). Where the hub cannot be
reached, the same `load_documents` reads any local dataset of the same schema (`data.DatasetSource`); what a
name means is decided in `data.calibration_source`.
"""

from __future__ import annotations

import numpy as np
import torch

from taylor_tune.errors import CalibrationError
from taylor_tune.progress import bar
from taylor_tune.sources.data import DatasetSource, calibration_source, load_dataset_rows


def split_paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def load_documents(source: str | DatasetSource) -> list[str]:
    """The source's non-empty documents: a dataset's rows, or a text file's blank-line separated paragraphs."""
    if isinstance(source, str):
        source = calibration_source(source)
    if isinstance(source, DatasetSource):
        return [t for t in load_dataset_rows(source) if t and t.strip()]
    try:
        return split_paragraphs(source.read_text(encoding="utf-8"))
    except OSError as error:
        raise CalibrationError(f"calibration: cannot read {source}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise CalibrationError(f"calibration: {source} is not a UTF-8 text file") from None


def draw_calibration(
    tokenizer, documents: list[str], *, seq_len: int, num_samples: int, seed: int, name: str = "source"
) -> torch.Tensor:
    """[num_samples, seq_len] token ids (int64), nested across num_samples for a fixed seed."""
    needed = seq_len * num_samples
    order = np.random.default_rng(seed).permutation(len(documents))
    separator = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    stream: list[int] = []
    with bar(needed, f"calibration ({name})", unit="tok", unit_scale=True) as progress:
        for index in order:
            if stream:
                stream += separator
            before = len(stream)
            stream += tokenizer(documents[index], add_special_tokens=False)["input_ids"]
            progress.update(min(len(stream), needed) - min(before, needed))
            if len(stream) >= needed:
                break
    if len(stream) < needed:
        raise CalibrationError(
            f"calibration: {name} has {len(stream)} tokens, {len(stream) // seq_len} sequences of {seq_len}; "
            f"{num_samples} were asked for ({needed} tokens)"
        )
    return torch.tensor(stream[:needed], dtype=torch.long).view(num_samples, seq_len)


def load_calibration(
    tokenizer, source: str | DatasetSource, *, seq_len: int, num_samples: int, seed: int
) -> torch.Tensor:
    name = source if isinstance(source, str) else source.path
    return draw_calibration(
        tokenizer, load_documents(source), seq_len=seq_len, num_samples=num_samples, seed=seed, name=name
    )
