"""Calibration draws: deterministic, nested, made of the source's text, and clear when the source is too small."""

import json

import pytest
import torch

from taylor_tune.errors import CalibrationError
from taylor_tune.sources.calibration import draw_calibration, load_documents, split_paragraphs
from taylor_tune.sources.data import DATASETS, DatasetSource
from taylor_tune.sources.models import byte_tokenizer

DOCS = [f"Document {i} talks about the river number {i} and its {i * 3} bridges." for i in range(200)]


def draw(n, seq_len=16, seed=0, docs=DOCS):
    return draw_calibration(byte_tokenizer(), docs, seq_len=seq_len, num_samples=n, seed=seed)


def test_draws_are_nested_and_deterministic():
    big, small = draw(50), draw(7)
    assert big.shape == (50, 16) and big.dtype == torch.long
    assert torch.equal(big[:7], small)
    assert torch.equal(draw(50), big)
    assert not torch.equal(draw(7, seed=1), small)


def test_every_sequence_is_a_piece_of_the_source_text():
    tok = byte_tokenizer()
    text = "\n\n".join(DOCS)
    for row in draw(30, seq_len=24):
        piece = tok.decode(row.tolist())
        # a window may straddle two documents, joined by the separator in some seeded order
        assert all(part in text for part in piece.split("\n\n") if part)


def test_too_small_a_source_says_how_much_it_has():
    with pytest.raises(CalibrationError, match=r"sequences of 64; 1000 were asked for"):
        draw(1000, seq_len=64, docs=DOCS[:10])


def test_text_files_split_into_paragraphs(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("first para\nstill first\n\n\nsecond\n\n  \n")
    assert load_documents(str(path)) == ["first para\nstill first", "second"]
    assert split_paragraphs("a\n\nb") == ["a", "b"]


def test_the_dataset_loader_runs_on_a_local_dataset_of_the_same_schema(tmp_path):
    # The same load_documents code that reads WikiText-2 / C4 from the hub, on a local json dataset.
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS[:50] + ["", "   "]))
    source = DatasetSource(path="json", data_files={"train": str(path)}, split="train")
    assert load_documents(source) == DOCS[:50]


def test_the_hub_datasets_are_the_ones_llm_pruner_uses():
    assert (DATASETS["wikitext2"].path, DATASETS["wikitext2"].name) == ("wikitext", "wikitext-2-raw-v1")
    assert DATASETS["c4"].path == "allenai/c4"


def test_an_unreachable_dataset_is_a_clear_error():
    with pytest.raises(CalibrationError, match="cannot load dataset 'wikitext'"):
        load_documents("wikitext2")  # the tests run with the hub offline


def test_a_missing_column_is_named(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(CalibrationError, match="no column 'text'"):
        load_documents(DatasetSource(path="json", data_files={"train": str(path)}))
