"""Instruction data for recovery (LLM-Pruner's recipe): Alpaca records become the Alpaca prompt and its response, the
loss is taken on the response tokens only (equal to a per-token loop over them), the records load through `datasets`
as from a local file, and a bad instruction file is refused before Ray starts."""

import json

import pytest
import torch
import torch.nn.functional as F

from taylor_tune.config import RecoverySpec
from taylor_tune.errors import CalibrationError
from taylor_tune.recovery.losses import distillation_loss, next_token_loss
from taylor_tune.recovery.train import recover
from taylor_tune.sources.data import DatasetSource
from taylor_tune.sources.instructions import load_instructions
from taylor_tune.sources.models import load_tokenizer
from taylor_tune.sources.recovery_data import instruction_batches, recovery_data
from tests.helpers import tiny
from tests.test_refused_before_work import experiment, nothing_started, one_line, run

RECORDS = [
    {"instruction": "Name a colour.", "input": "", "output": "Blue."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "2 and 3 make 5."},
    {"instruction": "Say nothing long.", "output": "Done."},  # no input field at all
]


def alpaca_text(record: dict) -> str:
    """The Alpaca template, written out here independently of the package's copy."""
    if record.get("input"):
        return ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n### Instruction:\n"
                f"{record['instruction']}\n\n### Input:\n{record['input']}\n\n### Response:\n")
    return ("Below is an instruction that describes a task. Write a response that appropriately completes the "
            f"request.\n\n### Instruction:\n{record['instruction']}\n\n### Response:\n")


def test_next_token_and_distillation_losses_on_masked_targets_equal_a_loop_over_them():
    torch.manual_seed(0)
    logits, teacher = torch.randn(3, 7, 13), torch.randn(3, 7, 13)
    ids = torch.randint(0, 13, (3, 7))
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1]])
    ce, kl = [], []
    for b in range(3):
        for t in range(6):
            if mask[b, t + 1]:  # position t predicts token t+1, a response token
                ce.append(float(F.cross_entropy(logits[b, t][None].double(), ids[b, t + 1][None])))
                p = torch.log_softmax(teacher[b, t].double() / 2, -1)
                q = torch.log_softmax(logits[b, t].double() / 2, -1)
                kl.append(float((p.exp() * (p - q)).sum()))
    assert float(next_token_loss(logits, ids, mask)) == pytest.approx(sum(ce) / len(ce), rel=1e-6)
    assert float(distillation_loss(logits, teacher, 2.0, mask)) == pytest.approx(sum(kl) / len(kl) * 4, rel=1e-5)
    ones = torch.ones_like(ids)
    assert float(next_token_loss(logits, ids, ones)) == pytest.approx(float(next_token_loss(logits, ids)), rel=1e-6)
    assert float(next_token_loss(logits, ids, torch.zeros_like(ids))) == 0.0  # no target: 0, not NaN


@pytest.mark.parametrize("model", ["tiny-llama", pytest.param("smollm2-135m", marks=pytest.mark.real)])
def test_each_row_is_the_alpaca_prompt_then_the_response_and_only_the_response_is_a_target(model, request):
    if model != "tiny-llama":
        request.getfixturevalue("assets")  # the real offline world, fetched when missing
    tokenizer = load_tokenizer(model)
    spec = RecoverySpec(steps=2, micro_batch_size=3, seq_len=160, seed=1)
    ids, mask = instruction_batches(tokenizer, RECORDS, spec)
    assert ids.shape == mask.shape == (6, 160)
    seen = []
    for row in range(6):
        real = int((mask[row].nonzero().max() + 1) if mask[row].any() else 0)
        decoded_response = tokenizer.decode(ids[row][mask[row].bool()][:-1])  # without the end-of-sequence token
        record = next(r for r in RECORDS if r["output"] == decoded_response)
        seen.append(record["output"])
        head = tokenizer(alpaca_text(record))["input_ids"]
        tail = tokenizer(record["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert ids[row, :real].tolist() == (head + tail)[:160]
        assert mask[row].tolist() == [0] * len(head) + [1] * len(tail) + [0] * (160 - len(head) - len(tail))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        assert set(ids[row, real:].tolist()) <= {pad}
    # each record once before any twice (a seeded order, then a new one)
    assert sorted(seen[:3]) == sorted(r["output"] for r in RECORDS) == sorted(seen[3:])
    # the prompt fills 8 tokens, nothing of any response survives the cutoff: refused, not trained on nothing
    shortest = min(len(tokenizer(alpaca_text(r))["input_ids"]) for r in RECORDS)
    with pytest.raises(CalibrationError, match=f"recovery.seq_len: 8 tokens hold only the prompt of every record "
                                               f"drawn \\(the shortest is {shortest} tokens\\)"):
        instruction_batches(tokenizer, RECORDS, spec.model_copy(update={"seq_len": 8}))


def test_records_load_through_datasets_as_from_the_file(tmp_path):
    jsonl = tmp_path / "alpaca.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    direct = load_instructions(str(jsonl))
    through = load_instructions(DatasetSource(path="json", data_files={"train": str(jsonl)}))  # the hub's path
    assert [(r["instruction"], r["output"]) for r in direct] == [(r["instruction"], r["output"]) for r in through]
    listed = tmp_path / "alpaca.json"
    listed.write_text(json.dumps(RECORDS))
    assert load_instructions(str(listed)) == direct


@pytest.mark.slow  # trains for seconds
def test_recovery_on_instruction_data_trains_on_the_responses(tmp_path):
    jsonl = tmp_path / "alpaca.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in RECORDS * 4))
    spec = RecoverySpec(data=str(jsonl), steps=4, lr=5e-3, warmup_steps=0, micro_batch_size=4, seq_len=160,
                        lora_dropout=0.0)
    model, tokenizer = tiny("tiny-llama"), load_tokenizer("tiny-llama")
    ids, mask = recovery_data(tokenizer, spec, "tiny-llama")
    assert mask is not None and mask.sum() < mask.numel() / 4  # the prompts are most of each row

    def response_loss(m) -> float:
        with torch.no_grad():
            return float(next_token_loss(m(input_ids=ids).logits, ids, mask))

    before = response_loss(model)
    recovered = recover(model, ids, ids[:2], spec, mask=mask)
    assert response_loss(recovered.model) < before


@pytest.mark.parametrize("content, expected", [
    ('{"instruction": "x"}\n', "record 0 is not an Alpaca record"),
    ("not json\n", "is not UTF-8 JSON lines"),
    ("", "holds no records"),
])
def test_a_bad_instruction_file_is_refused_before_ray(capsys, tmp_path, content, expected):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    code, _, err = run(capsys, "sweep", experiment(tmp_path, recovery={"data": str(bad)}))
    one_line(code, err, "recovery.data:", expected)
    nothing_started(tmp_path)


def test_a_huge_response_is_tokenized_only_as_far_as_the_window_needs():
    """Issue 62, finding 2: a record whose output is megabytes was tokenized whole before the cut to seq_len (8-10 GB
    and no end for 50 MB). Now the tokenizer sees a prefix sized from seq_len, and the row equals the whole text's
    tokens cut at seq_len."""
    from taylor_tune.sources.recovery_data import head_ids

    tokenizer = load_tokenizer("tiny-llama")
    huge = {"instruction": "Repeat the words.", "input": "", "output": "the words " * 500_000}  # 5 MB
    lengths = []

    class Spy:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, text, **kwargs):
            lengths.append(len(text))
            return tokenizer(text, **kwargs)

    spec = RecoverySpec(steps=1, micro_batch_size=1, seq_len=256)
    ids, mask = instruction_batches(Spy(), [huge], spec)
    assert max(lengths) <= 8 * 256 * 4 and mask.any()
    prompt = tokenizer(alpaca_text(huge))["input_ids"]
    whole = tokenizer(huge["output"][:100_000], add_special_tokens=False)["input_ids"]  # far more than the window
    assert ids[0].tolist() == (prompt + whole)[:256]
    assert head_ids(tokenizer, "short text", 64) == tokenizer("short text")["input_ids"]
