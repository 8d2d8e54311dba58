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

PrefixLM keeps the accelerator busy: a batch's token ids, position ids and segment numbers are laid out on the host
with one step per pack and per request (never per token) and go to the device in one copy; the block-causal mask is
built there from the segments (`attention`: "sdpa", an additive [rows, 1, width, width] mask for transformers' SDPA
attention; or "flex", a FlexAttention block mask computed from the same segments, with the model's attention switched
to transformers' flex_attention for the call); every continuation's log-likelihood and greedy check are computed there
(one log-softmax over the kept positions, in chunks, one gather, sums by `index_add_`); and the answers come back in
one copy per batch, queued behind the batch's work while the host prepares the next batch. With `fused` the
decoder layers run compiled for the pass (`evaluation.fused`): the same computation with its elementwise kernels fused.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM

from taylor_tune.compat.lm_eval import check
from taylor_tune.evaluation.fused import compiled_layers
from taylor_tune.progress import bar
from taylor_tune.sources.streaming import CHUNK_TOKENS, final_hidden, head_logits, is_stream, passes


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


class _Scorer(HFLM):
    """HFLM taking each request's tokens from `encoded` when the pass has them (`evaluation.requests`: lm-eval's own
    tokenization, done once per pass or read from the sweep's cache) instead of tokenizing it again. lm-eval draws
    its "Tokenizing inputs" bar with disable=False whatever TQDM_DISABLE says (the CLI sets it to keep library bars
    off); here that bar, and HFLM's own, follow the variable."""

    encoded: dict[tuple[str, str], tuple[list[int], list[int]]] | None = None  # (context, continuation) -> tokens

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        disable_tqdm = disable_tqdm or os.environ.get("TQDM_DISABLE") == "1"
        known = self.encoded
        if known and all(request.args in known for request in requests):
            return self._loglikelihood_tokens([(request.args, *known[request.args]) for request in requests],
                                              disable_tqdm=disable_tqdm)
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)


class CountingHFLM(_Scorer):
    """lm-eval's HFLM, counting the token positions it forwards (padding included)."""

    tokens_forwarded = 0  # padding included

    def _model_call(self, inps, attn_mask=None, labels=None):
        self.tokens_forwarded += inps.numel()
        return super()._model_call(inps, attn_mask=attn_mask, labels=labels)


def plan_batches(packs: list[Pack], rows: int | None, budget: int | None = None) -> list[list[list[Pack]]]:
    """Forward passes of `rows` rows each (or rows × width ≤ `budget` tokens): the longest pack not yet placed sets
    the batch's width, and every row is filled first-fit with the packs that follow (longest first), so that short
    items fill the padding beside long ones instead of adding rows."""
    batches, batch, filled, width = [], [], [], 0  # filled[i]: the tokens batch[i] holds
    for pack in packs:  # longest first
        length = pack.length
        row = next((i for i, used in enumerate(filled) if used + length <= width), None)
        if row is not None:
            batch[row].append(pack)
            filled[row] += length
            continue
        if batch and (len(batch) == rows or (budget and (len(batch) + 1) * width > budget)):
            batches.append(batch)
            batch, filled = [], []
        if not batch:
            width = length
        batch.append([pack])
        filled.append(length)
    return batches + [batch] if batch else batches


def token_budget(model, free_bytes: int, widest: int, dtype_bytes: int) -> int:
    """Tokens per forward pass that fit in half of `free_bytes`, for a batch as wide as `widest`: per token the
    hidden states and MLP activations of one layer at a time (inference frees each layer's), its row of the 4-D
    additive mask (`widest` entries) and of the boolean tensors it is built from (three bytes an entry), and a float32
    row of logits (the worst case: every position kept)."""
    config = model.config
    per_token = (dtype_bytes * (8 * config.hidden_size + 3 * config.intermediate_size) + (dtype_bytes + 3) * widest
                 + 4 * config.vocab_size)
    return max(widest, free_bytes // 2 // per_token)


@dataclass
class Prepared:
    """One forward pass, built on the host: `inputs` [5, rows, width] (token ids, position ids, segment of each
    position, the segment it also sees, kept or not) and `scored` [3, entries] (kept row, target token, request slot
    of every scored token, sorted by kept row); `requests` maps a slot to its request's index."""

    inputs: torch.Tensor
    scored: torch.Tensor
    requests: list[int]
    kept: int
    unpadded: int


def additive_mask(segment: torch.Tensor, prefix_of: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The block-causal mask of a packed batch, on the segments' device: a position sees the earlier positions of its
    own segment and of its pack's prefix (padding, a segment of its own, only itself, so no row is all -inf). As the
    additive [rows, 1, width, width] float mask that transformers' eager and SDPA attention accept."""
    column = torch.arange(segment.shape[1], device=segment.device)
    seen = segment[:, None, :]
    allowed = (column[None, :] <= column[:, None]) & ((seen == segment[:, :, None]) | (seen == prefix_of[:, :, None]))
    return torch.zeros(allowed.shape, dtype=dtype, device=segment.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min).unsqueeze(1)


def block_mask(segment: torch.Tensor, prefix_of: torch.Tensor):
    """The same mask as a FlexAttention BlockMask: computed block by block from the segments, never materialized as
    [rows, width, width]; the kernel skips the blocks in which no query sees any key."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(row, head, query, key):
        seen = segment[row, key]
        return (key <= query) & ((seen == segment[row, query]) | (seen == prefix_of[row, query]))

    rows, width = segment.shape
    return create_block_mask(mask_mod, B=rows, H=None, Q_LEN=width, KV_LEN=width, device=segment.device)


@contextmanager
def attention_implementation(model, name: str):
    """The model's attention switched to transformers' `name` implementation for the duration."""
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


# elements of one float32 log-softmax chunk over the vocabulary (64 MiB): bounds the scoring's memory
SOFTMAX_ELEMENTS = 1 << 24


class PrefixLM(_Scorer):
    """HFLM whose `_loglikelihood_tokens` forwards each shared prefix once (see the module's docstring). `batch_size`
    counts rows per forward pass, each row holding one or more items; with "auto" a forward pass holds up to a token
    budget sized from the free GPU memory and the widest pack actually in the data (never lm-eval's probe at the
    model's maximum context, which is 32k tokens for Qwen2); `token_budget` set on the instance overrides it. Out of
    memory, the budget halves and the passes not done are planned again, once per call."""

    tokens_forwarded = 0  # padding included: what the accelerator pays for
    tokens_unpadded = 0
    token_budget: int | None = None  # tokens per forward pass with batch_size "auto"; None: from the free memory
    attention: str = "sdpa"  # or "flex": the packed mask as a FlexAttention block mask (see the module's docstring)
    fused: bool = False  # the decoder layers compiled for each pass (evaluation.fused)
    compiled_graphs = 0  # graphs the fused passes traced (1 per model class when all goes as designed)

    def _budget(self, packs: list[Pack]) -> int:
        if self.token_budget is not None:
            return self.token_budget
        widest = packs[0].length if packs else 1
        if self.device.type != "cuda":  # no allocator to ask: 16 rows of the widest pack, as a fixed batch would
            return 16 * widest
        free, _ = torch.cuda.mem_get_info(self.device)
        dtype = self.mixed_precision_dtype or self.model.dtype
        return token_budget(self.model, free, widest, torch.finfo(dtype).bits // 8)

    def _prepare(self, batch: list[list[Pack]]) -> Prepared:
        """A batch's inputs and scoring indices, built on the host with one Python step per pack and per request
        (never per token), ready to go to the device in two copies."""
        rows, width = len(batch), sum(pack.length for pack in batch[0])
        ids = np.zeros((rows, width), dtype=np.int64)
        positions = np.zeros((rows, width), dtype=np.int64)
        segment = -1 - np.arange(rows * width, dtype=np.int64).reshape(rows, width)  # padding: a segment of its own
        prefix_of = segment.copy()  # the segment a position sees besides its own (its pack's prefix)
        keep = np.zeros((rows, width), dtype=bool)
        at_row, at_column, targets, owners, requests = [], [], [], [], []
        number = 0
        for row, packs in enumerate(batch):
            start = 0
            for pack in packs:
                p = len(pack.prefix)
                ids[row, start : start + p] = pack.prefix
                positions[row, start : start + p] = np.arange(p)
                segment[row, start : start + p] = prefix_of[row, start : start + p] = prefix = number
                number += 1
                keep[row, start + p - 1 : start + pack.length] = True
                column = start + p
                for index, cont in pack.members:
                    n = len(cont) - 1  # its last token is predicted, never forwarded
                    ids[row, column : column + n] = cont[:-1]
                    positions[row, column : column + n] = np.arange(p, p + n)  # continuing from the prefix
                    segment[row, column : column + n], prefix_of[row, column : column + n] = number, prefix
                    number += 1
                    # the prefix's last position predicts the first token, the continuation's own positions the rest
                    at_column.append(np.concatenate(([start + p - 1], np.arange(column, column + n))))
                    at_row.append(np.full(n + 1, row))
                    targets.append(cont)
                    owners.append(np.full(n + 1, len(requests)))
                    requests.append(index)
                    column += n
                start = column
        kept_row = np.cumsum(keep.ravel()).reshape(rows, width) - 1  # a kept position's row in the kept logits
        scored = np.stack([kept_row[np.concatenate(at_row), np.concatenate(at_column)],
                           np.concatenate(targets), np.concatenate(owners)])
        scored = scored[:, np.argsort(scored[0], kind="stable")]  # by kept row: each chunk of rows is one slice
        inputs = torch.from_numpy(np.stack([ids, positions, segment, prefix_of, keep.astype(np.int64)]))
        return Prepared(inputs, torch.from_numpy(scored), requests, int(keep.sum()),
                        sum(pack.length for packs in batch for pack in packs))

    def _forward(self, prepared: Prepared) -> torch.Tensor:
        """Forward one prepared batch and score it on the device: [2, requests] float64, each request's summed
        log-likelihood and its count of tokens that are not the greedy choice. Nothing is read back here.

        Only the positions that predict a continuation token go through the output layer (transformers' boolean
        `logits_to_keep`): with a 150k-word vocabulary the full [rows, width, vocab] logits are gigabytes."""
        inputs, keep, scored = self._on_device(prepared)
        with torch.no_grad(), self._autocast():
            logits = self.model(**inputs, use_cache=False, logits_to_keep=keep).logits  # [kept, vocab], row-major
            return self._score(prepared, logits, scored)

    def _autocast(self):
        return torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                              enabled=self.mixed_precision_dtype is not None)

    def _on_device(self, prepared: Prepared) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """A prepared batch on the device: the model's keyword inputs (token ids, the packed mask, position ids), the
        kept positions and the scoring indices."""
        on_cuda = self.device.type == "cuda"  # pinned host memory: the copies do not wait for the device
        inputs, scored = (t.pin_memory().to(self.device, non_blocking=True) if on_cuda else t
                          for t in (prepared.inputs, prepared.scored))
        ids, positions, segment, prefix_of, keep = inputs
        if self.attention == "flex":
            mask = block_mask(segment, prefix_of)
        else:
            mask = additive_mask(segment, prefix_of, self.mixed_precision_dtype or self.model.dtype)
        self.tokens_forwarded += ids.numel()
        self.tokens_unpadded += prepared.unpadded
        return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}, keep.bool(), scored

    def _score(self, prepared: Prepared, logits: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
        """[2, requests] from the kept positions' logits: each request's summed log-likelihood and its count of
        tokens that are not the greedy choice."""
        kept_row, target, owner = scored
        logprob = torch.empty(target.shape, dtype=torch.float64, device=self.device)
        greedy = torch.empty(target.shape, dtype=torch.bool, device=self.device)
        # the log-softmax a few thousand rows at a time: [kept, vocab] in float32 at once can be gigabytes
        step = max(1, SOFTMAX_ELEMENTS // logits.shape[-1])
        bounds = np.searchsorted(prepared.scored[0].numpy(), np.arange(0, prepared.kept + step, step))
        for chunk, first in enumerate(range(0, prepared.kept, step)):
            a, b = int(bounds[chunk]), int(bounds[chunk + 1])
            rows = F.log_softmax(logits[first : first + step], dim=-1, dtype=self.softmax_dtype)
            local = kept_row[a:b] - first
            logprob[a:b] = rows[local, target[a:b]].double()
            greedy[a:b] = rows.argmax(-1)[local] == target[a:b]
        per_request = torch.zeros(2, len(prepared.requests), dtype=torch.float64, device=self.device)
        per_request[0].index_add_(0, owner, logprob)
        per_request[1].index_add_(0, owner, (~greedy).double())
        return per_request

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        if self.backend != "causal":
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        max_length = self.max_length  # a property that resolves the model's config on every read
        for _, context, continuation in requests:
            assert len(context) > 0 and 0 < len(continuation) <= max_length  # HFLM's own preconditions
        packs = plan_packs([(context, continuation) for _, context, continuation in requests], max_length)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        pbar = bar(
            len(requests), "zero-shot", unit="req"
        )  # ours, so shown on a terminal even when library bars are off
        auto = self.batch_size == "auto"
        budget = self._budget(packs) if auto else None
        batches = plan_batches(packs, None if auto else self.batch_size, budget=budget)

        def collect(pending: tuple[Prepared, torch.Tensor, object]) -> None:
            """Read one batch's answers: its one copy to the host (waited for only now)."""
            prepared, host, ready = pending
            if ready is not None:
                ready.synchronize()
            sums, misses = host.tolist()
            for slot, index in enumerate(prepared.requests):
                answer = (sums[slot], misses[slot] == 0)
                results[index] = answer
                if requests[index][0] is not None:  # None: a rolling window, cached per document by the caller
                    self.cache_hook.add_partial("loglikelihood", requests[index][0], answer)
            pbar.update(len(prepared.requests))

        done, retried, pending = 0, False, None
        on_cuda = self.device.type == "cuda"
        prepared = self._prepare(batches[0]) if batches else None
        with (attention_implementation(self.model, "flex_attention") if self.attention == "flex" else nullcontext(),
              compiled_layers(self.model) if self.fused else nullcontext() as compiled):
            while done < len(batches):
                try:
                    scored = self._forward(prepared)
                except torch.OutOfMemoryError:
                    if not auto or retried:
                        raise
                    retried, budget = True, max(1, budget // 2)  # once per call: a second failure is not transient
                    if on_cuda:
                        torch.cuda.empty_cache()
                    rest = sorted((pack for batch in batches[done:] for row in batch for pack in row),
                                  key=lambda pack: (-pack.length, pack.prefix))  # the planner's order: longest first
                    batches = batches[:done] + plan_batches(rest, None, budget=budget)
                    prepared = self._prepare(batches[done])
                    continue
                # the copy to the host is queued behind the batch's work; the next batch is prepared while it runs
                host = torch.empty(scored.shape, dtype=scored.dtype, pin_memory=on_cuda)
                host.copy_(scored, non_blocking=on_cuda)
                ready = torch.cuda.Event() if on_cuda else None
                if ready is not None:
                    ready.record()
                if pending is not None:
                    collect(pending)
                pending, done = (prepared, host, ready), done + 1
                prepared = self._prepare(batches[done]) if done < len(batches) else None
            if pending is not None:
                collect(pending)
        self.compiled_graphs += compiled.graphs if compiled is not None else 0
        pbar.close()
        return results


class StreamedPrefixLM(PrefixLM):
    """PrefixLM over a model held layer by layer (`sources.streaming`): every batch of a call is planned and laid out
    first, then they go in passes of at most `chunk_tokens` tokens, each pass's batches through each decoder layer in
    turn (each layer's weights reach the device once a pass), then each batch's kept positions through the head and
    the same scoring. The same packs, batches, masks and arithmetic as PrefixLM's, so the same log-likelihoods."""

    stream = None  # the Checkpoint (or Resident) whose `model` this HFLM was made around
    chunk_tokens = CHUNK_TOKENS  # tokens of one layer-major pass (`sources.streaming.passes`)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        max_length = self.max_length
        for _, context, continuation in requests:
            assert len(context) > 0 and 0 < len(continuation) <= max_length  # HFLM's own preconditions
        packs = plan_packs([(context, continuation) for _, context, continuation in requests], max_length)
        auto = self.batch_size == "auto"
        batches = plan_batches(packs, None if auto else self.batch_size, budget=self._budget(packs) if auto else None)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        prepared = [self._prepare(batch) for batch in batches]
        with torch.no_grad(), self._autocast():
            for run in passes(prepared, lambda batch: batch.inputs[0].numel(), self.chunk_tokens):
                placed = [self._on_device(batch) for batch in run]  # one pass's inputs on the device at a time
                finals = final_hidden(self.stream, [inputs for inputs, _, _ in placed], chunk_tokens=sys.maxsize)
                for batch, (_, keep, scored), hidden in zip(run, placed, finals, strict=True):
                    sums, misses = self._score(batch, head_logits(self.stream.model, hidden, keep), scored).tolist()
                    for slot, index in enumerate(batch.requests):
                        results[index] = answer = (sums[slot], misses[slot] == 0)
                        if requests[index][0] is not None:
                            self.cache_hook.add_partial("loglikelihood", requests[index][0], answer)
        return results


def make_lm(model, tokenizer, batch_size: int | str, scorer: str = "prefix", fused: bool = False) -> HFLM:
    """The lm-eval LM for an in-memory model on its own device, in its own dtype, or for a model held layer by
    layer (`sources.streaming`: the prefix scorer, streamed); log-softmax in float32. `fused`: the prefix scorer's
    decoder layers compiled for each pass (`evaluation.fused`)."""
    stream = model if is_stream(model) else None
    if stream is not None:
        model = stream.model
        if scorer != "prefix" or fused:
            raise ValueError("a streamed model is scored by the prefix scorer, not fused")
    device = next(model.parameters()).device
    if batch_size == "auto" and device.type != "cuda":
        batch_size = 16  # lm-eval's auto search probes GPU memory; on CPU a fixed size is faster and predictable
    cls = StreamedPrefixLM if stream is not None else {"prefix": PrefixLM, "hflm": CountingHFLM}[scorer]
    # log-softmax in float32 whatever the model's dtype: in bfloat16 a log-probability is rounded to 8 bits of
    # mantissa, and two scorers that forward other shapes then disagree by more than the rounding of the logits
    lm = cls(pretrained=model, tokenizer=tokenizer, device=str(device), batch_size=batch_size,
             softmax_dtype=torch.float32)
    check(lm)  # the HFLM internals PrefixLM relies on
    lm.scorer, lm.stream = scorer, stream
    if fused and scorer == "prefix":
        lm.fused = True
    return lm
