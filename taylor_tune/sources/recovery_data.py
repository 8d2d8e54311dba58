"""The recovery's token rows, drawn from its data before any training: text drawn as calibration is (nested,
seeded), Alpaca records as the Alpaca prompt and its response with the mask of the response tokens (the loss's
targets), and the held-out windows the recovery's loss is measured on. `check_recovery_data` judges before the run
what the draw would give. The instruction records themselves (read, checked) are `sources.instructions`, which
stays torch-free for the experiment file's checks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from taylor_tune.config import RecoverySpec
from taylor_tune.errors import CalibrationError
from taylor_tune.sources.calibration import load_calibration, load_documents
from taylor_tune.sources.data import load_ppl_text, resolve_text
from taylor_tune.sources.instructions import is_instruction_data, load_instructions, prompt_and_response


def recovery_ids(tokenizer, spec: RecoverySpec, model_name: str | None) -> torch.Tensor:
    """[spec.sequences, seq_len] token ids of the recovery text (the calibration draw's rules: nested, seeded)."""
    return load_calibration(tokenizer, resolve_text(spec.data, model_name), seq_len=spec.seq_len,
                            num_samples=spec.sequences, seed=spec.seed)


def head_ids(tokenizer, text: str, limit: int, **kwargs) -> list[int]:
    """The tokens of `text`, of which at least the first `limit` are right, tokenizing a prefix that grows (x4) until
    it gives more than `limit` + 16 tokens: the cost follows `limit`, not the text (a 50 MB response is never
    tokenized whole). Cutting a text changes only the tokens of its last word, beyond the margin kept."""
    size = max(256, 8 * limit)
    while True:
        ids = tokenizer(text[:size], **kwargs)["input_ids"]
        if size >= len(text):
            return ids
        if len(ids) > limit + 16:
            return ids[:limit]
        size *= 4


def instruction_batches(tokenizer, records: list[dict], spec: RecoverySpec) -> tuple[torch.Tensor, torch.Tensor]:
    """[spec.sequences, seq_len] token ids of Alpaca prompts and their responses (drawn without replacement in a
    seeded order, again in a new order when the set is smaller), and the mask of the response tokens (the loss's
    targets; the end-of-sequence token included). Cut at seq_len (LLM-Pruner's cutoff), padded on the right, which
    a causal model's earlier positions never see. A draw in which every prompt fills the window, so that no response
    token is kept, is refused (CalibrationError): it would train on nothing and report a recovery."""
    import random

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    rng, order = random.Random(spec.seed), []
    ids = torch.full((spec.sequences, spec.seq_len), pad, dtype=torch.long)
    mask = torch.zeros((spec.sequences, spec.seq_len), dtype=torch.long)
    shortest = None  # the shortest prompt drawn, in tokens
    for row in range(spec.sequences):
        if not order:
            order = list(range(len(records)))
            rng.shuffle(order)
        prompt, response = prompt_and_response(records[order.pop()])
        head = head_ids(tokenizer, prompt, spec.seq_len)  # the tokenizer's own special tokens (a BOS) lead
        tail = head_ids(tokenizer, response, spec.seq_len, add_special_tokens=False) + eos
        tokens = (head + tail)[: spec.seq_len]
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, len(head): len(tokens)] = 1
        shortest = len(head) if shortest is None else min(shortest, len(head))
    if not mask.any():
        raise CalibrationError(f"recovery.seq_len: {spec.seq_len} tokens hold only the prompt of every record drawn "
                               f"(the shortest is {shortest} tokens), so no response token would be trained on; "
                               f"raise recovery.seq_len above {shortest}")
    return ids, mask


def recovery_data(tokenizer, spec: RecoverySpec, model_name: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recovery's token ids [spec.sequences, seq_len] and the mask of the tokens the loss predicts (None: every
    token, for text; the responses, for instruction data)."""
    if is_instruction_data(spec.data):
        return instruction_batches(tokenizer, load_instructions(spec.data), spec)
    return recovery_ids(tokenizer, spec, model_name), None


# The most instruction rows a check before the run tokenizes: the first rows of the trial's own draw.
CHECKED_ROWS = 256


def check_recovery_data(tokenizer, spec: RecoverySpec, model_name: str | None, memory_bytes: int) -> None:
    """CalibrationError, before the run, where `recovery_data` could not give what `spec` asks: token tensors larger
    than `memory_bytes` (ids and mask, int64: the step count sets their size), more text tokens than the text can
    hold (at most one per UTF-8 byte: refused without tokenizing), the text's own draw (an empty or unreadable file),
    or, for a local instruction file, no response token kept in the first CHECKED_ROWS rows drawn."""
    needed = spec.sequences * spec.seq_len
    if 16 * needed > memory_bytes:
        raise CalibrationError(f"recovery.steps: {spec.steps} steps of {spec.grad_accum} x {spec.micro_batch_size} "
                               f"sequences of {spec.seq_len} tokens are {16 * needed / 2**30:.1f} GiB of token ids "
                               f"before any training, more than the {memory_bytes / 2**30:.1f} GiB this machine has")
    if is_instruction_data(spec.data):
        if Path(spec.data).is_file():
            rows = -(-CHECKED_ROWS // (spec.micro_batch_size * spec.grad_accum))
            instruction_batches(tokenizer, load_instructions(spec.data), spec.model_copy(
                update={"steps": min(spec.steps, rows), "warmup_steps": 0}))
        return
    text = resolve_text(spec.data, model_name)
    documents = load_documents(text)
    most = sum(len(d.encode("utf-8")) for d in documents) + 2 * len(documents)
    if needed > most:
        raise CalibrationError(f"recovery.steps: {spec.sequences} sequences of {spec.seq_len} tokens are {needed} "
                               f"tokens, and the recovery text {text} holds at most {most}")
    recovery_ids(tokenizer, spec, model_name)


def heldout_ids(tokenizer, text: str, spec: RecoverySpec) -> torch.Tensor:
    """[heldout_windows, seq_len] token ids: the first windows of a resolved perplexity text (the held-out text the
    evaluation scores; recovery never trains on it)."""
    ids = tokenizer(load_ppl_text(text), add_special_tokens=False)["input_ids"]
    windows = min(spec.heldout_windows, len(ids) // spec.seq_len)
    if windows == 0:
        raise ValueError(f"recovery: the held-out text {text} holds fewer than seq_len {spec.seq_len} tokens")
    return torch.tensor(ids[: windows * spec.seq_len]).view(windows, spec.seq_len)
