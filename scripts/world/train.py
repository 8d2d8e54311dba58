"""Train a tiny causal LM on the world's corpus (CPU, minutes): used by scripts/make_offline_world.py.

Plain next-token training: AdamW, linear warm-up then cosine decay, random windows of the tokenized corpus,
a fixed number of steps so that the result depends on the seed, not on the machine's speed.
"""

from __future__ import annotations

import math
import time

import torch


def train_causal_lm(model, token_ids: torch.Tensor, *, steps: int, batch_size: int = 32, seq_len: int = 128,
                    lr: float = 3e-3, warmup: int = 50, seed: int = 0, log_every: int = 50) -> list[float]:
    """Train `model` in place on random windows of the 1-D `token_ids`; returns the loss of every step."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    losses, start = [], time.perf_counter()
    for step in range(steps):
        offsets = torch.randint(0, token_ids.numel() - seq_len - 1, (batch_size,), generator=generator)
        batch = torch.stack([token_ids[o : o + seq_len] for o in offsets.tolist()])
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"  step {step:5d}  loss {loss.item():.3f}  {time.perf_counter() - start:6.1f}s", flush=True)
    model.eval()
    return losses


def train_tokenizer(text: str, vocab_size: int = 512):
    """A byte-level BPE trained on `text` (deterministic), wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    core.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
