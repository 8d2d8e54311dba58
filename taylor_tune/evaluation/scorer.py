"""lm-eval scorers of an in-memory model: lm-eval's own HFLM, and `PrefixLM`, which forwards each shared context once.

A multiple-choice item asks for log P(continuation | context) of several continuations of one context. HFLM
forwards every (context, continuation) pair as its own sequence (it shares a context only between one-token
continuations). PrefixLM packs an item into one sequence: the context once, then every continuation's tokens,
each continuation attending to the context and to itself only (a block-causal 4-D mask), its position ids
continuing from the end of the context. That is the same computation as HFLM's, with the context's
positions forwarded once instead of once per continuation.

What is scored is HFLM's definition exactly, because PrefixLM is an HFLM: lm-eval's tokenization of the pair
(trailing whitespace moved to the continuation, the prefix token for an empty context), HFLM's left truncation
to `max_length + 1` tokens, the log-probabilities of the continuation tokens summed, and is_greedy. Only the
forward pass is shared. Both scorers count the token positions they forward, padding included (what the
accelerator pays for), as `tokens_forwarded`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM

from taylor_tune.compat.lm_eval import check
from taylor_tune.progress import bar


@dataclass
class Pack:
    """Requests whose HFLM inputs share everything up to the continuation: `prefix` is forwarded once and its last
    position predicts every continuation's first token; `members` are (request index, continuation tokens)."""

    prefix: tuple[int, ...]
    members: list[tuple[int, list[int]]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.prefix) + sum(len(cont) - 1 for _, cont in self.members)


def plan_packs(requests: list[tuple[list[int], list[int]]], max_length: int) -> list[Pack]:
    """Group (context, continuation) token lists by the prefix of HFLM's model input, longest pack first.

    HFLM's input is `(context + continuation)[-(max_length + 1):][:-1]`; its last len(continuation) - 1 tokens
    are the continuation's, so what precedes them is the prefix. Grouping by the prefix after truncation means
    two continuations of one long context that truncate differently simply land in different packs."""
    packs: dict[tuple[int, ...], Pack] = {}
    for index, (context, continuation) in enumerate(requests):
        model_input = (context + continuation)[-(max_length + 1):][:-1]
        prefix = tuple(model_input[: len(model_input) - len(continuation) + 1])
        packs.setdefault(prefix, Pack(prefix)).members.append((index, continuation))
    return sorted(packs.values(), key=lambda pack: (-pack.length, pack.prefix))


class _LibraryBarsFollowTqdmDisable(HFLM):
    """lm-eval draws its "Tokenizing inputs" bar with disable=False whatever TQDM_DISABLE says (the CLI sets it to
    keep library bars off); here that bar, and HFLM's own, follow the variable."""

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or os.environ.get("TQDM_DISABLE") == "1")


class CountingHFLM(_LibraryBarsFollowTqdmDisable):
    """lm-eval's HFLM, counting the token positions it forwards (padding included)."""

    tokens_forwarded = 0  # padding included

    def _model_call(self, inps, attn_mask=None, labels=None):
        self.tokens_forwarded += inps.numel()
        return super()._model_call(inps, attn_mask=attn_mask, labels=labels)


def plan_batches(packs: list[Pack], rows: int | None, budget: int | None = None) -> list[list[list[Pack]]]:
    """Forward passes of `rows` rows each (or rows × width ≤ `budget` tokens): the longest pack not yet placed sets
    the batch's width, and every row is filled first-fit with the packs that follow (longest first), so that short
    items fill the padding beside long ones instead of adding rows."""
    batches, batch, width = [], [], 0
    for pack in packs:  # longest first
        row = next((r for r in batch if sum(p.length for p in r) + pack.length <= width), None)
        if row is not None:
            row.append(pack)
            continue
        if batch and (len(batch) == rows or (budget and (len(batch) + 1) * width > budget)):
            batches.append(batch)
            batch = []
        if not batch:
            width = pack.length
        batch.append([pack])
    return batches + [batch] if batch else batches


def token_budget(model, free_bytes: int, widest: int, dtype_bytes: int) -> int:
    """Tokens per forward pass that fit in half of `free_bytes`, for a batch as wide as `widest`: per token the
    hidden states and MLP activations of one layer at a time (inference frees each layer's), its row of the 4-D
    additive mask (`widest` entries), and a float32 row of logits (the worst case: every position kept)."""
    config = model.config
    per_token = (dtype_bytes * (8 * config.hidden_size + 3 * config.intermediate_size + widest)
                 + 4 * config.vocab_size)
    return max(widest, free_bytes // 2 // per_token)


class PrefixLM(_LibraryBarsFollowTqdmDisable):
    """HFLM whose `_loglikelihood_tokens` forwards each shared prefix once (see the module's docstring). `batch_size`
    counts rows per forward pass, each row holding one or more items; with "auto" a forward pass holds up to a token
    budget sized from the free GPU memory and the widest pack actually in the data (never lm-eval's probe at the
    model's maximum context, which is 32k tokens for Qwen2); `token_budget` set on the instance overrides it. Out of
    memory, the budget halves and the passes not done are planned again, once per call."""

    tokens_forwarded = 0  # padding included: what the accelerator pays for
    tokens_unpadded = 0
    token_budget: int | None = None  # tokens per forward pass with batch_size "auto"; None: from the free memory

    def _budget(self, packs: list[Pack]) -> int:
        if self.token_budget is not None:
            return self.token_budget
        widest = packs[0].length if packs else 1
        if self.device.type != "cuda":  # no allocator to ask: 16 rows of the widest pack, as a fixed batch would
            return 16 * widest
        free, _ = torch.cuda.mem_get_info(self.device)
        dtype = self.mixed_precision_dtype or self.model.dtype
        return token_budget(self.model, free, widest, torch.finfo(dtype).bits // 8)

    def _forward(self, batch: list[list[Pack]]) -> list[tuple[Pack, torch.Tensor]]:
        """Each pack with the logits of the positions that predict its continuations' tokens: its prefix's last
        position, then every continuation position, [pack length - len(prefix) + 1, vocab].

        Only those rows go through the output layer (transformers' boolean `logits_to_keep`): with a 150k-word
        vocabulary the full [rows, width, vocab] logits of a batch are gigabytes, and most of them are context."""
        width = sum(pack.length for pack in batch[0])
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        positions = torch.zeros(len(batch), width, dtype=torch.long)
        allowed = torch.eye(width, dtype=torch.bool).repeat(len(batch), 1, 1)  # padding attends to itself: no NaN rows
        keep = torch.zeros(len(batch), width, dtype=torch.bool)
        placed = []
        for row, packs in enumerate(batch):
            start = 0
            for pack in packs:
                placed.append((pack, row, start))
                p = len(pack.prefix)
                keep[row, start + p - 1 : start + pack.length] = True
                segments = [(list(pack.prefix), start)]  # (tokens, first column); positions restart at each pack
                column = start + p
                for _, cont in pack.members:
                    segments.append((cont[:-1], column))
                    column += len(cont) - 1
                for number, (tokens, first) in enumerate(segments):
                    n = len(tokens)
                    ids[row, first : first + n] = torch.tensor(tokens, dtype=torch.long)
                    positions[row, first : first + n] = torch.arange(p if number else 0, (p if number else 0) + n)
                    allowed[row, first : first + n, first : first + n] = torch.ones(n, n, dtype=torch.bool).tril()
                    if number:  # a continuation sees its pack's prefix
                        allowed[row, first : first + n, start : start + p] = True
                start = column
        dtype = self.mixed_precision_dtype or self.model.dtype
        # additive float mask: what both the eager and the SDPA attention of transformers accept as a custom 4-D mask
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min).unsqueeze(1)
        self.tokens_forwarded += ids.numel()
        self.tokens_unpadded += sum(pack.length for packs in batch for pack in packs)
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                             enabled=self.mixed_precision_dtype is not None):
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                position_ids=positions.to(self.device), use_cache=False,
                                logits_to_keep=keep.to(self.device)).logits  # [kept positions, vocab], row-major
        first_kept = (keep.flatten().cumsum(0) - 1).view_as(keep)  # a kept position's row in `logits`
        return [(pack, logits[first_kept[row, start + len(pack.prefix) - 1] :][: pack.length - len(pack.prefix) + 1])
                for pack, row, start in placed]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        if self.backend != "causal":
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        for _, context, continuation in requests:
            assert len(context) > 0 and 0 < len(continuation) <= self.max_length  # HFLM's own preconditions
        packs = plan_packs([(context, continuation) for _, context, continuation in requests], self.max_length)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        pbar = bar(
            len(requests), "zero-shot", unit="req"
        )  # ours, so shown on a terminal even when library bars are off
        auto = self.batch_size == "auto"
        budget = self._budget(packs) if auto else None
        batches = plan_batches(packs, None if auto else self.batch_size, budget=budget)
        done, retried = 0, False
        while done < len(batches):
            try:
                forwarded = self._forward(batches[done])
            except torch.OutOfMemoryError:
                if not auto or retried:
                    raise
                retried, budget = True, max(1, budget // 2)  # once per call: a second failure is not transient
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                rest = sorted((pack for batch in batches[done:] for row in batch for pack in row),
                              key=lambda pack: (-pack.length, pack.prefix))  # the planner's order: longest first
                batches = batches[:done] + plan_batches(rest, None, budget=budget)
                continue
            done += 1
            for pack, logits in forwarded:
                offset = 1  # row 0: the prefix's last position
                for index, cont in pack.members:
                    # the prefix's last position predicts the first token; the continuation's own positions the rest
                    rows = [0, *range(offset, offset + len(cont) - 1)]
                    offset += len(cont) - 1
                    logprobs = F.log_softmax(logits[rows], dim=-1, dtype=self.softmax_dtype)
                    target = torch.tensor(cont, dtype=torch.long, device=logprobs.device)
                    answer = (
                        float(logprobs.gather(1, target[:, None]).sum()),
                        bool((logprobs.argmax(-1) == target).all()),
                    )
                    results[index] = answer
                    if requests[index][0] is not None:  # None: a rolling window, cached per document by the caller
                        self.cache_hook.add_partial("loglikelihood", requests[index][0], answer)
                    pbar.update(1)
        pbar.close()
        return results


def make_lm(model, tokenizer, batch_size: int | str, scorer: str = "prefix") -> HFLM:
    """The lm-eval LM for an in-memory model on its own device, in its own dtype; log-softmax in float32."""
    device = next(model.parameters()).device
    if batch_size == "auto" and device.type != "cuda":
        batch_size = 16  # lm-eval's auto search probes GPU memory; on CPU a fixed size is faster and predictable
    cls = {"prefix": PrefixLM, "hflm": CountingHFLM}[scorer]
    # log-softmax in float32 whatever the model's dtype: in bfloat16 a log-probability is rounded to 8 bits of
    # mantissa, and two scorers that forward other shapes then disagree by more than the rounding of the logits
    lm = cls(pretrained=model, tokenizer=tokenizer, device=str(device), batch_size=batch_size,
             softmax_dtype=torch.float32)
    check(lm)  # the HFLM internals PrefixLM relies on
    lm.scorer = scorer
    return lm
