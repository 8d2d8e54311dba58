"""Recovery fine-tuning: LoRA adapters (peft) on a pruned model, trained on recovery text, then merged.

`recover` reads top to bottom: draw the recovery text, attach the adapters, train `steps` optimizer steps (AdamW,
linear warm-up then linear decay, gradient accumulation), measure the held-out loss before, every `eval_every`
steps and after, merge the adapters into the weights. The adapters are float32 whatever the model's dtype (peft's
`autocast_adapter_dtype`), the losses are computed in float32. Writes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from taylor_tune.config import RecoverySpec
from taylor_tune.errors import CalibrationError
from taylor_tune.recovery.losses import distillation_loss, next_token_loss, token_losses
from taylor_tune.sources.calibration import load_calibration, load_documents
from taylor_tune.sources.data import load_ppl_text, resolve_text
from taylor_tune.sources.instructions import is_instruction_data, load_instructions, prompt_and_response


@dataclass
class Recovered:
    """The merged model, the held-out loss before and after and at each `eval_every`, and the seconds spent."""

    model: torch.nn.Module
    loss_before: float
    loss_after: float
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss), step 0 first
    train_loss: list[float] = field(default_factory=list)  # per optimizer step
    seconds: float = 0.0


def attach_lora(model: torch.nn.Module, spec: RecoverySpec) -> PeftModel:
    """The model with LoRA adapters on `spec.target_modules` of every decoder layer (B = 0: the output is unchanged
    until training moves it)."""
    torch.manual_seed(spec.seed)
    config = LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha, lora_dropout=spec.lora_dropout,
                        target_modules=list(spec.target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


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


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, ids: torch.Tensor, micro_batch_size: int) -> float:
    """Mean next-token loss over the held-out windows (every predicted token weighs the same), in eval mode: the
    adapters' dropout off."""
    was_training = model.training
    device = next(model.parameters()).device
    model.eval()
    total = 0.0
    try:
        for batch in ids.split(micro_batch_size):
            batch = batch.to(device)
            total += float(token_losses(model(input_ids=batch).logits, batch).sum())
    finally:
        model.train(was_training)
    return total / ids[:, 1:].numel()


def schedule(spec: RecoverySpec) -> Callable[[int], float]:
    """The learning rate's multiplier at a step: linear warm-up to 1, then linear decay to 0 at `steps`."""

    def factor(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / (spec.warmup_steps + 1)
        return max(0.0, (spec.steps - step) / max(1, spec.steps - spec.warmup_steps))

    return factor


def step_loss(model, batch: torch.Tensor, spec: RecoverySpec, teacher: torch.nn.Module | None,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    logits = model(input_ids=batch).logits
    if spec.loss == "ce":
        return next_token_loss(logits, batch, mask)
    with torch.no_grad():
        teacher_logits = teacher(input_ids=batch).logits
    kd = distillation_loss(logits, teacher_logits, spec.temperature, mask)
    if spec.loss == "kd":
        return kd
    return (1 - spec.kd_weight) * next_token_loss(logits, batch, mask) + spec.kd_weight * kd


def recover(model: torch.nn.Module, ids: torch.Tensor, heldout: torch.Tensor, spec: RecoverySpec, *,
            mask: torch.Tensor | None = None, teacher: torch.nn.Module | None = None,
            report: Callable[[int, float, float], None] | None = None) -> Recovered:
    """Train LoRA adapters on `ids` ([spec.sequences, seq_len]; `mask`: the tokens the loss predicts, None for
    all) and merge them; `heldout` ([n, seq_len]) is measured before, every `eval_every` steps (each passed to
    `report(step, held-out loss, mean training loss of the steps since the last point)`) and after. `teacher`: the
    unpruned model, for `kd` and `ce+kd`."""
    if spec.loss != "ce" and teacher is None:
        raise ValueError(f"recovery.loss {spec.loss} needs the unpruned model as teacher")
    start = time.perf_counter()
    device = next(model.parameters()).device
    before = heldout_loss(model, heldout, spec.micro_batch_size)
    curve = [(0, before)]
    peft_model = attach_lora(model, spec)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=spec.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(spec))
    if teacher is not None:
        teacher.eval()
    peft_model.train()
    losses, batches = [], ids.split(spec.micro_batch_size)
    masks = [None] * len(batches) if mask is None else mask.split(spec.micro_batch_size)
    for step in range(spec.steps):
        total = 0.0
        part = slice(step * spec.grad_accum, (step + 1) * spec.grad_accum)
        for micro, micro_mask in zip(batches[part], masks[part]):
            micro_mask = None if micro_mask is None else micro_mask.to(device)
            loss = step_loss(peft_model, micro.to(device), spec, teacher, micro_mask) / spec.grad_accum
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        if spec.eval_every and (step + 1) % spec.eval_every == 0 and step + 1 < spec.steps:
            curve.append((step + 1, heldout_loss(peft_model, heldout, spec.micro_batch_size)))
            if report is not None:
                report(*curve[-1], sum(losses[-spec.eval_every:]) / spec.eval_every)
    merged = peft_model.merge_and_unload()
    merged.eval()
    after = heldout_loss(merged, heldout, spec.micro_batch_size)
    curve.append((spec.steps, after))
    return Recovered(merged, before, after, curve, losses, time.perf_counter() - start)
