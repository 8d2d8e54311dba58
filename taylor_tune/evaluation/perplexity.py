"""Perplexity as LLM-Pruner defines it, on an in-memory model.

The text is tokenized once and cut into non-overlapping windows of `window` tokens (the last partial window is
dropped); ppl = exp(mean NLL of every predicted token, i.e. positions 1..W-1 of each window). Which text a
name means is decided in `sources.data`.
"""

from __future__ import annotations

import math

import torch

from taylor_tune.errors import EvaluationError
from taylor_tune.progress import bar


def check_window(window: int, model_config) -> None:
    limit = getattr(model_config, "max_position_embeddings", None)
    if limit is not None and window > limit:
        raise EvaluationError(f"ppl_window: {window} is longer than the model's maximum context of {limit} tokens")


@torch.no_grad()
def perplexity(
    model, tokenizer, text: str, *, window: int = 128, batch_size: int = 8, max_windows: int | None = None
) -> dict:
    """exp(mean token NLL) over non-overlapping windows (the first `max_windows` if given); returns ppl, window,
    windows and tokens scored, and `ppl_curve`: [windows, ppl over those first windows] after each batch (a cheaper
    perplexity's value, for free: what a search could have stopped on)."""
    check_window(window, model.config)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    count = ids.numel() // window
    if count == 0:
        raise EvaluationError(f"ppl: the text has {ids.numel()} tokens, fewer than one window of {window}")
    count = min(count, max_windows or count)
    windows = ids[: count * window].view(count, window)
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64)
    curve = []
    with bar(count * window, "perplexity", unit="tok", unit_scale=True) as progress:
        for start in range(0, count, batch_size):
            batch = windows[start : start + batch_size].to(device)
            logits = model(input_ids=batch, use_cache=False).logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
            )
            total += nll.double().cpu()
            progress.update(batch.numel())
            done = min(start + batch_size, count)
            curve.append([done, math.exp(float(total) / (done * (window - 1)))])
    scored = count * (window - 1)
    return {"ppl": math.exp(float(total) / scored), "ppl_window": window, "ppl_windows": count, "ppl_tokens": scored,
            "ppl_curve": curve}
