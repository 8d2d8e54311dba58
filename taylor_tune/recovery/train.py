"""Recovery fine-tuning: LoRA adapters (peft) on a pruned model, trained on recovery text, then merged.

`recover` reads top to bottom: draw the recovery text, attach the adapters, train `steps` optimizer steps (AdamW,
linear warm-up then linear decay, gradient accumulation), measure the held-out loss before, every `eval_every`
steps and after, merge the adapters into the weights. The adapters are float32 whatever the model's dtype (peft's
`autocast_adapter_dtype`), the losses are computed in float32. Writes nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from taylor_tune.config import RecoverySpec
from taylor_tune.recovery.losses import distillation_loss, next_token_loss, token_losses
from taylor_tune.sources.models import load_model
from taylor_tune.sources.recovery_data import heldout_ids, recovery_data


@dataclass
class Recovered:
    """The merged model, the held-out loss before and after and at each `eval_every`, and the seconds spent."""

    model: torch.nn.Module
    loss_before: float
    loss_after: float
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss), step 0 first
    train_loss: list[float] = field(default_factory=list)  # per optimizer step
    seconds: float = 0.0

    def metrics(self, spec: RecoverySpec) -> dict:
        """A trial's recovery columns: the held-out loss (and perplexity) before and after, the training loss over
        the steps since the curve's last point before the end, and at the last step, the seconds."""
        tail = self.train_loss[(spec.points - 1) * (spec.eval_every or 0):]
        return {"recovery_heldout_loss_before": self.loss_before, "recovery_heldout_loss_after": self.loss_after,
                "recovery_heldout_loss": self.loss_after, "recovery_step": spec.steps,
                "recovery_train_loss_last": self.train_loss[-1], "recovery_train_loss": sum(tail) / len(tail),
                "recovery_heldout_ppl_before": math.exp(self.loss_before),
                "recovery_heldout_ppl_after": math.exp(self.loss_after), "recovery_s": self.seconds}


def attach_lora(model: torch.nn.Module, spec: RecoverySpec) -> PeftModel:
    """The model with LoRA adapters on `spec.target_modules` of every decoder layer (B = 0: the output is unchanged
    until training moves it)."""
    torch.manual_seed(spec.seed)
    config = LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha, lora_dropout=spec.lora_dropout,
                        target_modules=list(spec.target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


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


def recover_pruned(model: torch.nn.Module, tokenizer, spec: RecoverySpec, *, model_name: str, heldout_text: str,
                   trust_remote_code: bool = False, seed: int = 0,
                   report: Callable[[int, float, float], None] | None = None) -> Recovered:
    """`recover` as a trial runs it, from the model's name: the unpruned model loaded as the teacher (in the pruned
    model's dtype and device) only for kd and ce+kd, and freed after; the held-out windows of `heldout_text` (a
    resolved perplexity text); the recovery rows of `spec.data`."""
    parameter = next(model.parameters())
    teacher = None if spec.loss == "ce" else load_model(
        model_name, device=parameter.device, dtype=parameter.dtype, trust_remote_code=trust_remote_code, seed=seed)
    held = heldout_ids(tokenizer, heldout_text, spec)
    ids, mask = recovery_data(tokenizer, spec, model_name)
    recovered = recover(model, ids, held, spec, mask=mask, teacher=teacher, report=report)
    del teacher
    if parameter.device.type == "cuda":
        torch.cuda.empty_cache()
    return recovered
