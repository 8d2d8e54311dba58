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
    windows and tokens scored, `ppl_curve`: [windows, ppl over those first windows] after each batch (a cheaper
    perplexity's value, for free: what a search could have stopped on), and `window_nll`: each window's summed NLL
    over its window - 1 predicted tokens (ppl is exp of their exact sum over the tokens: two models compare paired,
    window by window)."""
    check_window(window, model.config)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    count = ids.numel() // window
    if count == 0:
        raise EvaluationError(f"ppl: the text has {ids.numel()} tokens, fewer than one window of {window}")
    count = min(count, max_windows or count)
    windows = ids[: count * window].view(count, window)
    device = next(model.parameters()).device
    summed: list[float] = []  # each window's summed NLL (float64 over float32 token losses)
    curve = []
    with bar(count * window, "perplexity", unit="tok", unit_scale=True) as progress:
        for start in range(0, count, batch_size):
            batch = windows[start : start + batch_size].to(device)
            logits = model(input_ids=batch, use_cache=False).logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none"
            )
            summed += nll.double().view(len(batch), window - 1).sum(dim=1).cpu().tolist()
            progress.update(batch.numel())
            curve.append([len(summed), math.exp(math.fsum(summed) / (len(summed) * (window - 1)))])
    scored = count * (window - 1)
    return {"ppl": math.exp(math.fsum(summed) / scored), "ppl_window": window, "ppl_windows": count,
            "ppl_tokens": scored, "ppl_curve": curve, "window_nll": summed}
