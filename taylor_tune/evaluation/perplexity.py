"""Perplexity as LLM-Pruner defines it, on an in-memory model or one held layer by layer (`sources.streaming`).

The text is tokenized once and cut into non-overlapping windows of `window` tokens (the last partial window is
dropped); ppl = exp(mean NLL of every predicted token, i.e. positions 1..W-1 of each window). Which text a
name means is decided in `sources.data`.
"""

from __future__ import annotations

import math

import torch

from taylor_tune.config import PPL_BATCH
from taylor_tune.errors import EvaluationError
from taylor_tune.progress import bar
from taylor_tune.sources.streaming import batch_logits, is_stream


def check_window(window: int, model_config) -> None:
    limit = getattr(model_config, "max_position_embeddings", None)
    if limit is not None and window > limit:
        raise EvaluationError(f"ppl_window: {window} is longer than the model's maximum context of {limit} tokens")


def windows_of(tokenizer, text: str, window: int, max_windows: int | None) -> torch.Tensor:
    """The text's non-overlapping windows (count x window token ids), the first `max_windows` if given."""
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    count = ids.numel() // window
    if count == 0:
        raise EvaluationError(f"ppl: the text has {ids.numel()} tokens, fewer than one window of {window}")
    count = min(count, max_windows or count)
    return ids[: count * window].view(count, window)


def curve_of(window_nll: list[float], window: int, batch_size: int) -> list[list]:
    """[windows, ppl over those first windows] after each batch of `batch_size` windows."""
    ends = [*range(batch_size, len(window_nll), batch_size), len(window_nll)]
    return [[n, math.exp(math.fsum(window_nll[:n]) / (n * (window - 1)))] for n in ends]


@torch.no_grad()
def perplexity(
    model, tokenizer, text: str, *, window: int = 128, batch_size: int = PPL_BATCH, max_windows: int | None = None,
    select: list[int] | None = None,
) -> dict:
    """exp(mean token NLL) over non-overlapping windows (the first `max_windows` if given; of those, the ones
    `select` lists, in its order); returns ppl, window, windows and tokens scored, `ppl_curve`: [windows, ppl over
    those first windows] after each batch (a cheaper perplexity's value, for free: what a search could have stopped
    on), `window_nll`: each window's summed NLL over its window - 1 predicted tokens (ppl is exp of their exact sum
    over the tokens: two models compare paired, window by window), and `window_ids`: which windows those are."""
    check_window(window, (model.model if is_stream(model) else model).config)
    windows = windows_of(tokenizer, text, window, max_windows)
    ids = list(range(len(windows))) if select is None else [int(i) for i in select]
    if not ids or min(ids) < 0 or max(ids) >= len(windows):
        raise EvaluationError(f"ppl: windows {ids[:5]}... are not among the text's {len(windows)}")
    windows, count = windows[ids], len(ids)
    summed: list[float] = []  # each window's summed NLL (float64 over float32 token losses)
    batches = [windows[start : start + batch_size] for start in range(0, count, batch_size)]
    with bar(count * window, "perplexity", unit="tok", unit_scale=True) as progress:
        for batch, logits in zip(batches, batch_logits(model, batches), strict=True):
            batch, logits = batch.to(logits.device), logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none"
            )
            summed += nll.double().view(len(batch), window - 1).sum(dim=1).cpu().tolist()
            progress.update(batch.numel())
    scored = count * (window - 1)
    return {"ppl": math.exp(math.fsum(summed) / scored), "ppl_window": window, "ppl_windows": count,
            "ppl_tokens": scored, "ppl_curve": curve_of(summed, window, batch_size), "window_nll": summed,
            "window_ids": ids}
