"""The exported model's card: README.md in the hub's model-card format (YAML front matter, then Markdown): what the
model is, its configuration, its numbers with their intervals as the sweep measured them, where it came from and
the command that makes it again. Pure: text from records."""

from __future__ import annotations

import math
import re

import yaml

from taylor_tune.config import SERVABLE_TILE
from taylor_tune.export.choose import Chosen
from taylor_tune.reporting.stats import Z95, wilson_interval
from taylor_tune.schema import task_columns, task_key
from taylor_tune.sources.assets import ASSETS

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def base_model(model: str) -> str | None:
    """The hub id the pruned model came from: a hub spec itself, a built-in asset's recorded id; else None."""
    if model in ASSETS and ASSETS[model].hub_id:
        return ASSETS[model].hub_id
    return model if _HUB_ID.match(model) and not model.startswith((".", "/")) else None


def plain(value, count: bool = False):
    """A number as Python writes it: numpy's scalars (`np.int64(7)` under repr) as the int or float they hold; a
    `count` (params_count, which the report's table holds as a float) as an int."""
    value = value.item() if hasattr(value, "item") and not isinstance(value, (list, dict, str)) else value
    return int(value) if count and isinstance(value, float) and value.is_integer() else value


def settings_read(prune: dict) -> dict:
    """The pruning settings the trial's method read: a setting of another method (blockwise's layer range for a
    taylor trial), another criterion (flap_compensation without flap) or another layout (uniform_multiple without
    uniform) is left out of the card, as it changed nothing."""
    method, criterion = prune.get("method"), prune.get("criterion")
    unread = set()
    if method != "blockwise":
        unread |= {"blockwise_layer_start", "blockwise_layer_end", "blockwise_attention"}
    if method != "layerwise":
        unread.add("layerwise_max_ratio")
    if criterion != "flap":
        unread.add("flap_compensation")
    if method != "depth" and not prune.get("depth_share"):
        unread |= {"depth_criterion", "depth_share"}
    if not prune.get("uniform"):
        unread.add("uniform_multiple")
    if method == "experts":  # the dense criterion is the width methods'
        unread |= {"criterion", "flap_compensation"}
    return {k: v for k, v in prune.items() if k not in unread and v is not None}


def experts_section(experts: list[list[int]] | None) -> list[str]:
    """The card's table of the experts each sparse layer kept (their indices in the unpruned model), for a mixture
    pruned by the experts method."""
    if not experts:
        return []
    rows = [f"| {layer} | {', '.join(map(str, kept))} |" for layer, kept in enumerate(experts) if kept]
    return ["## Experts kept", "", "Each sparse layer's experts that stay, by their index in the unpruned model (the "
            "router's rows and the experts' weights of the others are removed; a layer not listed is dense):", "",
            "| layer | experts kept |", "|---|---|", *rows, ""]


def title(prune: dict) -> str:
    if prune["method"] == "experts":
        return (f"experts by {prune['expert_criterion']}, {prune['expert_sparsity']:g} of each sparse layer's experts "
                "removed")
    return f"{prune['method']} at {prune['sparsity']:g} sparsity"


def trial_place(folder: str) -> str:
    """Where the trial lies within its sweep (`<experiment>/<trial folder>`): the card is for publishing, so the
    machine's own path to the sweep stays out of it."""
    parts = [part for part in str(folder).rstrip("/").replace("\\", "/").split("/") if part]
    return "/".join(parts[-2:])


def _number(value, digits: int = 4) -> str:
    return "–" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.{digits}f}"


def metrics_table(row: dict) -> list[str]:
    """The trial's reported numbers, each with its 95% interval where the sweep measured one."""
    lines = ["| metric | value | 95% interval |", "|---|---:|---|"]
    acc, se = row.get("acc_mean"), row.get("acc_mean_stderr")
    if acc is not None:
        interval = f"{acc - Z95 * se:.4f} – {acc + Z95 * se:.4f}" if isinstance(se, float) and se == se else "–"
        lines.append(f"| acc_mean (mean of the task accuracies) | {_number(acc)} | {interval} |")
    for task in task_columns(row):
        value, n = row[task_key(task)], row.get(task_key(task, "_n"))
        bounds = wilson_interval(value, int(n)) if isinstance(n, (int, float)) and n == n else None
        lines.append(f"| {task_key(task)} | {_number(value)} | "
                     f"{'–' if bounds is None else f'{bounds[0]:.4f} – {bounds[1]:.4f} (Wilson, {int(n)} items)'} |")
    if row.get("ppl") is not None:
        lines.append(f"| held-out perplexity ({row.get('ppl_source', '')}) | {_number(row['ppl'], 3)} | – |")
    for rate in ("prefill", "decode", "decode_batch"):
        key = f"{rate}_speedup"
        if row.get(key) is not None:
            low, high = row.get(f"{key}_low"), row.get(f"{key}_high")
            lines.append(f"| {key} (against the unpruned model, timed interleaved) | {_number(row[key], 3)} | "
                         f"{'–' if low is None or high is None else f'{low:.3f} – {high:.3f}'} |")
    for key in ("params_count", "active_params_count", "pruning_ratio", "recovery_heldout_loss"):
        if row.get(key) is not None and row.get(key) == row.get(key):  # a dense trial's active count: NaN
            count = key.endswith("params_count")
            lines.append(f"| {key} | {plain(row[key], True) if count else _number(row[key])} | – |")
    return lines


def gguf_section(gguf: dict | None) -> list[str]:
    """How to run the folder's GGUF in llama.cpp, and what its check measured."""
    if not gguf:
        return []
    check = gguf["check"]
    said = (f"read back by llama.cpp, its per-token log-probabilities on a check passage ({check['tokens']} tokens) "
            f"are within {check['mean_abs_logprob_gap']:.2g} nats of the model's on average, "
            f"{check['max_abs_logprob_gap']:.2g} at most" if check.get("checked") else f"not checked: {check['why']}")
    return ["## llama.cpp", "",
            f"`{gguf['file']}`: {gguf['file_type']}, architecture `{gguf['architecture']}`"
            + (" (per-layer head counts and feed-forward widths)" if gguf["architecture"] == "deci" else "")
            + f"; {said}.", "", "```sh", f"llama-cli -m {gguf['file']} -p \"The river rises\"", "```", "",
            "```python", "from llama_cpp import Llama", f"llm = Llama(model_path=\"{gguf['file']}\")", "```", ""]


def layout_said(layout: str, prune: dict) -> str:
    """The card's words for the model's layout (`config.layout_name`): a free layout says that its widths are not
    aligned, what that costs in llama.cpp and which setting avoids it; an aligned or servable one, its multiple."""
    if layout == "servable":
        return (f"servable: every layer's attention kept and every MLP width a multiple of "
                f"{prune.get('align') or SERVABLE_TILE}, the shapes DeciLM's per-layer format holds (`servable: true`; "
                "`export --format decilm` writes it for vLLM, TensorRT-LLM and SGLang)")
    if layout.startswith("align "):
        multiple = layout.removeprefix("align ")
        return f"free, every kept width a multiple of {multiple} (`align: {multiple}`)"
    if layout == "free":
        return ("free, each layer's widths as its importance earned them, not aligned: llama.cpp prefills such widths "
                "slower than aligned ones (`align: 64` keeps the quality at the uniform layout's speed, BENCHMARKS.md)")
    if layout == "experts":
        return "experts: the same count of experts removed from every sparse layer, every layer stock otherwise"
    return layout


def model_card(chosen: Chosen, record: dict, checks: dict, *, layout: str, folder_format: str, command: str,
               gguf: dict | None = None, converter: str | None = None, experts: list[list[int]] | None = None) -> str:
    """README.md of the exported folder. `record`: the trial's config.json; `checks`: what the rebuild reproduced
    (name -> (reported, rebuilt)); `layout`: its layers' shapes (`config.layout_name`); `folder_format`: how the folder
    loads ("stock": transformers' own classes, "pruned": taylor_tune's pruned classes, "decilm"); `gguf`: what `--gguf`
    wrote (to_gguf.write_gguf's record with its check), if asked; `converter`: why llama.cpp's converter refuses a
    DeciLM folder, if it does (`to_decilm.converter_problem`); `experts`: a mixture's kept experts per layer (empty
    for a dense layer)."""
    prune, recovery = record["prune"], record.get("recovery")
    front = {"library_name": "transformers", "pipeline_tag": "text-generation",
             "tags": ["taylor-tune", "pruned", "structured-pruning", prune["method"],
                      *(["lora-recovered"] if recovery else []), *(["gguf"] if gguf else [])]}
    if base := base_model(prune["model"]):
        front = {"base_model": base} | front
    settings = [f"| {k} | {plain(v)} |" for k, v in settings_read(prune).items()]
    recovered = [f"| recovery.{k} | {v} |" for k, v in (recovery or {}).items() if v is not None]
    loading = ("AutoModelForCausalLM.from_pretrained(folder)  # stock classes: every layer has one shape"
               if folder_format == "stock" else
               "# DeciLMForCausalLM (block_configs): vllm serve folder, or llama.cpp's convert_hf_to_gguf.py folder"
               if folder_format == "decilm" else
               "from taylor_tune.sources.models import load_pruned\nmodel = load_pruned(folder)  # per-layer widths: "
               "the pruned classes of taylor_tune (or trust_remote_code=True with the folder's own modeling file)")
    return "\n".join([
        "---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "",
        f"# {prune['model']}, pruned by taylor_tune: {title(prune)}"
        + (", recovered with LoRA" if recovery else ""), "",
        f"Structured pruning with group-normalized first-order Taylor importance (or the baseline named below), "
        f"chosen by a taylor_tune sweep as {chosen.why}. Layout: {layout_said(layout, prune)}.", "",
        "## Configuration", "", "| setting | value |", "|---|---|", *settings, *recovered, "",
        *experts_section(experts),
        "## Measured in the sweep", "",
        f"Trial `{chosen.trial_id}` of model `{chosen.model}`; ranked by {chosen.objective.metric} "
        f"({'lower' if chosen.objective.ascending else 'higher'} is better).", "",
        *metrics_table(chosen.row), "",
        "Rebuilt for this export and checked against the trial: "
        + "; ".join(f"{k} {plain(r, k == 'params_count')!r} (trial: {plain(t, k == 'params_count')!r})"
                    for k, (t, r) in checks.items()) + ".", "",
        "## Where it came from", "", f"- sweep trial folder: `{trial_place(chosen.folder)}`",
        f"- made again by: `{command}`", "",
        "## Loading", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "tokenizer = AutoTokenizer.from_pretrained(folder)", *(["model = " + loading] if folder_format == "stock"
                                                               else loading.splitlines()), "```", "",
        *([f"Not for llama.cpp's converter: {converter}.", ""] if converter else []),
        *gguf_section(gguf),
    ])
