"""A trial's peak memory, estimated before Ray starts from the model's shape and the trial's settings.

Pure arithmetic (no torch): each stage that allocates with the sizes a user sets is a sum of parts, and the trial's
peak is the largest stage. The estimate is a lower bound, so that a refusal is never wrong: a trial it refuses cannot
run in the memory it has (the refused inputs took 8-10 GB of a tiny model and never finished). The coefficients sit
below what the stages were measured to allocate on CPU in float32 and bfloat16 (`tests/sweep/test_memory.py` holds
each stage between 0.4 times the measured peak and the peak):
- a forward and backward pass keeps, per token and decoder layer, at least 6 hidden-wide and 3 MLP-wide values
  (SDPA does not keep the attention matrix);
- LoRA adds, per token and targeted projection, at least its dropped-out input;
- the logits are the vocabulary-wide part: their own dtype plus float32 copies for the loss (the upcast and the
  log-softmax's gradient; distillation's for both models);
- a forward without gradients holds one layer's transients at a time, or the logits after the last layer.
The zero-shot passes are not estimated: on CUDA the prefix scorer sizes its batches from the free memory, on CPU it
keeps 16 rows and only the continuations' logits.
"""

from __future__ import annotations

from dataclasses import dataclass

from taylor_tune.config import PPL_BATCH

GIB = 2**30


@dataclass(frozen=True)
class Shape:
    """What the estimate reads from a model's config and its meta-device layout."""

    params: int  # every parameter
    layer_params: int  # the decoder layers' (the Taylor pass keeps a float32 gradient sum of each)
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    kv_width: int  # key/value projection width: kv heads x head dim
    q_width: int  # query projection width: heads x head dim (not the hidden size where head_dim is given)

    @classmethod
    def of(cls, config, total_params: int, layer_params: int) -> Shape:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        # a mixture computes each token with its top-k experts: k x an expert's width (Qwen3-MoE's experts are
        # `moe_intermediate_size` wide beside its dense layers' `intermediate_size`; Mixtral's are the latter)
        routed = getattr(config, "num_experts_per_tok", None) or 0
        width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        return cls(total_params, layer_params, config.hidden_size, max(config.intermediate_size, routed * width),
                   config.num_hidden_layers, config.vocab_size, kv_heads * head_dim, heads * head_dim)

    def projections(self) -> dict[str, tuple[int, int]]:
        """Each LoRA target's (input, output) width."""
        h, i, q, kv = self.hidden, self.intermediate, self.q_width, self.kv_width
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass(frozen=True)
class StagePeak:
    """One stage's estimate: its parts in bytes, and the settings that size its largest one."""

    stage: str
    parts: dict[str, int]
    levers: str  # the settings a user changes to make it smaller

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def backward_pass(shape: Shape, tokens: int, dtype_bytes: int, per_layer_extra: int = 0) -> int:
    """Activations a forward keeps for its backward pass over `tokens` tokens."""
    per_token_layer = 6 * shape.hidden + 3 * shape.intermediate + per_layer_extra
    return tokens * shape.layers * per_token_layer * dtype_bytes


def forward_pass(shape: Shape, tokens: int, dtype_bytes: int) -> int:
    """One layer's transients of a forward without gradients."""
    return tokens * (2 * shape.hidden + 2 * shape.intermediate) * dtype_bytes


def logits(shape: Shape, tokens: int, dtype_bytes: int, float32_copies: int) -> int:
    return tokens * shape.vocab * (dtype_bytes + 4 * float32_copies)


def importance(shape: Shape, micro_batch_size: int, seq_len: int, dtype_bytes: int) -> StagePeak:
    """The Taylor pass: the weights, a float32 gradient sum per decoder parameter, one micro-batch's backward."""
    tokens = micro_batch_size * seq_len
    return StagePeak("importance pass", {
        "weights": shape.params * dtype_bytes,
        "gradient sums": 4 * shape.layer_params,
        "activations": backward_pass(shape, tokens, dtype_bytes),
        "logits": logits(shape, tokens, dtype_bytes, 2),
    }, f"micro_batch_size (or num_samples) {micro_batch_size} x seq_len {seq_len}")


def forward(stage: str, shape: Shape, tokens: int, dtype_bytes: int, loss_bytes: int, levers: str) -> StagePeak:
    """A forward without gradients over `tokens` tokens: the weights, and the larger of one layer's transients and
    the logits with `loss_bytes` more per logit where a loss is taken over them (the upcast and the log-softmax).
    The two are not held at once: a layer's transients are freed before the head computes the logits."""
    activations = forward_pass(shape, tokens, dtype_bytes)
    head = tokens * shape.vocab * (dtype_bytes + loss_bytes)
    return StagePeak(stage, {"weights": shape.params * dtype_bytes}
                     | ({"activations": activations} if activations > head else {"logits": head}), levers)


def calibration_forward(shape: Shape, micro_batch_size: int, seq_len: int, dtype_bytes: int) -> StagePeak:
    """A forward over calibration micro-batches with its loss (activation criteria, depth, measured losses)."""
    return forward("calibration forward", shape, micro_batch_size * seq_len, dtype_bytes, 6,
                   f"micro_batch_size (or num_samples) {micro_batch_size} x seq_len {seq_len}")


def perplexity(shape: Shape, window: int, dtype_bytes: int) -> StagePeak:
    return forward("perplexity", shape, PPL_BATCH * window, dtype_bytes, 6,
                   f"evaluation.ppl_window {window} ({PPL_BATCH} windows a forward)")


def speed(shape: Shape, prefill_batch: int, prefill_len: int, dtype_bytes: int, kept: float = 1.0) -> StagePeak:
    """The prefill's forward (no loss) with the unpruned model loaded beside the pruned one (`kept`: its share of the
    parameters), the two timed in turn; the decode's cache at its short prompts is smaller."""
    peak = forward("speed measurement", shape, prefill_batch * prefill_len, dtype_bytes, 0,
                   f"evaluation.speed.prefill_batch {prefill_batch} x prefill_len {prefill_len}")
    weights = peak.parts.pop("weights")
    return StagePeak(peak.stage, {"weights": int(weights * kept), "unpruned weights": weights, **peak.parts},
                     peak.levers)


def recovery(shape: Shape, spec, dtype_bytes: int, kept: float = 1.0) -> StagePeak:
    """LoRA training of the pruned model (`kept`: its share of the parameters): its weights (and the unpruned
    teacher's), the adapters with their gradients and AdamW's two moments in float32, one micro-batch's backward
    through every layer with its adapters, and the loss's logits. The student's weights, adapters and activations
    are scaled by `kept` as a whole: a cut removes at least that much of none of them (hidden-wide values stay)."""
    targets = [shape.projections()[name] for name in spec.target_modules]
    tokens = spec.micro_batch_size * spec.seq_len
    teacher = spec.loss != "ce"
    copies = {"ce": 2, "kd": 5, "ce+kd": 5}[spec.loss]
    adapters = shape.layers * sum(spec.lora_rank * (n_in + n_out) for n_in, n_out in targets)
    parts = {
        "weights": int(shape.params * dtype_bytes * (kept + teacher)),
        "adapters": int(16 * adapters * kept),
        "activations": int(backward_pass(shape, tokens, dtype_bytes, sum(n_in for n_in, _ in targets)) * kept),
        "logits": logits(shape, tokens, dtype_bytes, copies),
    }
    return StagePeak("recovery", parts, f"recovery.micro_batch_size {spec.micro_batch_size} x recovery.seq_len "
                                        f"{spec.seq_len}" + (f", lora_rank {spec.lora_rank}" if spec.lora_rank > 64
                                                             else ""))


def kept_share(shape: Shape, prune) -> float:
    """The least share of the parameters the pruned model keeps: 1 - sparsity, less what aligning its MLP widths
    (`align`, `servable`) may round down: half a block of channels per layer (`pruning.aligned`: to the nearest
    multiple), each channel a row of gate and up and a column of down."""
    align = None if prune.uniform else prune.servable_align
    rounded = shape.layers * (align // 2) * 3 * shape.hidden if align else 0
    return max(0.0, _kept(prune) - rounded / shape.params)


def _kept(prune) -> float:
    """1 - sparsity; the experts method's target is a share of the experts, not of the parameters: the whole
    model bounds what it keeps."""
    return 1.0 if prune.method == "experts" else 1 - prune.sparsity


def trial_peaks(shape: Shape, prune, evaluation, recovery_spec, dtype_bytes: int, *,
                draws_calibration: bool, uses_gradients: bool) -> list[StagePeak]:
    """The estimated peak of each stage of a trial that allocates with the sizes its settings set (`prune`: a
    PruneConfig, `evaluation`: the sweep's Evaluation, `recovery_spec`: a RecoverySpec or None; the flags:
    pruning.scoring's of `prune`)."""
    peaks = []
    if draws_calibration:
        rows = min(prune.micro_batch_size, prune.num_samples)  # a micro-batch holds at most the rows drawn
        if uses_gradients:
            peaks.append(importance(shape, rows, prune.seq_len, dtype_bytes))
        peaks.append(calibration_forward(shape, rows, prune.seq_len, dtype_bytes))
    if evaluation.ppl is not None:
        peaks.append(perplexity(shape, evaluation.ppl_window, dtype_bytes))
    if evaluation.speed is not None:
        peaks.append(speed(shape, evaluation.speed.prefill_batch, evaluation.speed.prefill_len, dtype_bytes,
                           _kept(prune)))
    if recovery_spec is not None:
        peaks.append(recovery(shape, recovery_spec, dtype_bytes, _kept(prune)))
    return peaks


def streamed_importance(shape: Shape, num_samples: int, micro_batch_size: int, seq_len: int,
                        dtype_bytes: int) -> StagePeak:
    """The Taylor pass streamed (`pruning.streamed`): the head's weights, one decoder layer's weights, its gradient
    and its float32 gradient sums, one micro-batch's backward through that layer alone, the loss's logits; and what
    the pass keeps on the host between layers: every layer's input for every calibration row, the last layer's
    output and the gradient flowing down (the `kept` part; on a GPU it is the host's, not the device's)."""
    layer = shape.layer_params // shape.layers
    one_layer = Shape(shape.params, shape.layer_params, shape.hidden, shape.intermediate, 1, shape.vocab,
                      shape.kv_width, shape.q_width)
    tokens = micro_batch_size * seq_len
    return StagePeak("streamed importance pass", {
        "head weights": (shape.params - shape.layer_params) * dtype_bytes,
        "one layer": layer * (2 * dtype_bytes + 4),
        "activations": backward_pass(one_layer, tokens, dtype_bytes),
        "logits": logits(shape, tokens, dtype_bytes, 2),
        "kept": num_samples * seq_len * shape.hidden * dtype_bytes * (shape.layers + 2),
    }, f"num_samples {num_samples} x seq_len {seq_len} (kept between layers)")


def streamed_forward(stage: str, shape: Shape, tokens: int, batch_tokens: int, dtype_bytes: int,
                     levers: str) -> StagePeak:
    """A forward streamed over `tokens` tokens in batches of `batch_tokens` (perplexity, the zero-shot passes): the
    head's weights and one layer's, one batch's transients or its logits with their float32 loss, and every batch's
    hidden state kept between layers (twice: a layer's input and its output)."""
    weights = (shape.params - shape.layer_params + shape.layer_params // shape.layers) * dtype_bytes
    activations = forward_pass(shape, batch_tokens, dtype_bytes)
    head = batch_tokens * shape.vocab * (dtype_bytes + 6)
    return StagePeak(stage, {"weights": weights, ("activations" if activations > head else "logits"):
                             max(activations, head), "kept": 2 * tokens * shape.hidden * dtype_bytes}, levers)


def streamed_peaks(shape: Shape, prune, evaluation, dtype_bytes: int) -> list[StagePeak]:
    """`trial_peaks` of a streamed trial (gradient scoring, no speed stage, no recovery: the preflight refuses those
    with streaming)."""
    peaks = [streamed_importance(shape, prune.num_samples, min(prune.micro_batch_size, prune.num_samples),
                                 prune.seq_len, dtype_bytes)]
    if evaluation.ppl is not None:
        windows = evaluation.ppl_max_windows or 0
        peaks.append(streamed_forward("streamed perplexity", shape, windows * evaluation.ppl_window,
                                      PPL_BATCH * evaluation.ppl_window, dtype_bytes,
                                      f"evaluation.ppl_max_windows {windows} x ppl_window {evaluation.ppl_window}"))
    return peaks


def streamed_places(peak: StagePeak, on_gpu: bool, host_bytes: int) -> dict[str, int]:
    """Where a streamed peak's parts live: what the passes keep between layers (`kept`) on the host, or on the
    scratch disk where it is more than half the host's memory (as a trial decides); the rest on the device (on CPU
    the device is the host)."""
    kept = peak.parts.get("kept", 0)
    rest = peak.total - kept
    on_disk = kept_on_disk(kept, host_bytes)
    if on_gpu:
        return {"device": rest, ("scratch disk" if on_disk else "host"): kept}
    return {"device": rest + (0 if on_disk else kept)} | ({"scratch disk": kept} if on_disk else {})


def kept_on_disk(kept: int, host_bytes: int) -> bool:
    """Whether what a streamed pass keeps between layers goes to the scratch disk: more than half the host's memory."""
    return kept > host_bytes // 2


def pruned_bytes(shape: Shape, prune, dtype_bytes: int) -> int:
    """The pruned model a streamed trial writes to its scratch folder: the parameters its cut keeps."""
    return int(shape.params * (1 - prune.sparsity) * dtype_bytes)


def streams(prune, in_memory: list[StagePeak], allowed: int) -> bool:
    """Whether a trial holds its model layer by layer: `prune.streaming` on, or auto where the model with its
    gradient buffers (the weights and gradient sums of its in-memory peaks, `trial_peaks`) exceeds what it may use
    and the pruning can be streamed (`PruneConfig.streaming_problem`). A peak made by a batch's activations is the
    batch's to lower, not a reason to stream."""
    if prune.streaming != "auto":
        return prune.streaming == "on"
    model = max((peak.parts.get("weights", 0) + peak.parts.get("gradient sums", 0) for peak in in_memory), default=0)
    return model > allowed and prune.streaming_problem() is None


def held_whole(evaluation, recovery_spec) -> str | None:
    """The stage of a trial that holds its whole model, which a streamed trial cannot have; None if none."""
    if evaluation.speed is not None:
        return "evaluation.speed (the unpruned and the pruned model timed whole)"
    return "recovery (LoRA trains the whole model)" if recovery_spec is not None else None


def describe(peak: StagePeak) -> str:
    parts = ", ".join(f"{name} {size / GIB:.1f}" for name, size in peak.parts.items())
    return f"the {peak.stage} needs at least {peak.total / GIB:.1f} GiB ({parts})"
