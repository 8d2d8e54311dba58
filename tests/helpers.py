"""Helpers shared by tests: tiny models and calibration tokens. torch is imported where it is used: conftest reads
ARCHS from here, and pytest-xdist's controller, which runs no test, then starts its workers without loading torch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from taylor_tune.sources.families import DENSE, FAMILIES  # pure declarations: no torch

if TYPE_CHECKING:
    import torch

ARCHS = [f"{FAMILIES[model_type].tiny_name}-random" for model_type in DENSE]
# The arch-wide tests (the `arch` fixture) run on these in the fast tier and on every family in `make test`; each
# family's own trait tests (tests/sources/test_families.py) and the diagonal of the arch x method grids run in both.
FAST_ARCHS = ARCHS[:4]


def tiny(name: str, seed: int = 0):
    import torch

    from taylor_tune.sources.models import load_model

    return load_model(name, device="cpu", dtype=torch.float32, seed=seed)


def fast_diagonal(first: list, second: list) -> list:
    """Every pair of `first` x `second` for pytest.mark.parametrize; the pairs off the diagonal carry the slow marker,
    so the fast tier still meets each value of each axis once and `make test` runs the whole grid."""
    import pytest

    longer = max(len(first), len(second))
    diagonal = {(k % len(first), k % len(second)) for k in range(longer)}
    return [pytest.param(a, b, id="-".join(str(v).removeprefix("torch.") for v in (a, b)),
                         marks=() if (i, j) in diagonal else pytest.mark.slow)
            for i, a in enumerate(first) for j, b in enumerate(second)]


def calibration_ids(num_samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    from taylor_tune.sources.calibration import load_calibration
    from taylor_tune.sources.models import byte_tokenizer

    return load_calibration(byte_tokenizer(), "sample", seq_len=seq_len, num_samples=num_samples, seed=seed)


def equal_layers(g: int, c: int, a: int, m: int, layers: int):
    """A ModelLayout of `layers` equal layers (g attention groups of a parameters, c MLP channels of m), nothing
    outside them."""
    from taylor_tune.pruning.plan import ModelLayout

    per_layer = g * a + c * m
    return ModelLayout((g,) * layers, (c,) * layers, a, m, (per_layer,) * layers, per_layer * layers)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kept_rows_rms_norm(norm, keep):
    """OLMo-2's RMSNorm over a projection's rows `keep` only, written out (the others give 0): what a pruned OLMo-2,
    whose q_norm / k_norm have only the kept rows, computes."""
    import torch

    class KeptRows(torch.nn.Module):
        def forward(self, x):
            kept = x[..., keep].float()
            normed = kept * torch.rsqrt(kept.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
            out = torch.zeros_like(x)
            out[..., keep] = (norm.weight[keep] * normed).to(x.dtype)
            return out

    return KeptRows()


def mask_groups(model, plan):
    """`model` with the plan's groups set to zero, index by index (not through apply.py); in place. In OLMo-2, whose
    q_norm / k_norm span the whole projections, those norms are replaced by norms over the kept rows
    (`kept_rows_rms_norm`): zeros counted in the mean would scale every kept head."""
    import torch

    cfg = model.config
    d, rep = head_dim_of(cfg), cfg.num_attention_heads // cfg.num_key_value_heads
    with torch.no_grad():
        for layer, attn_removed, mlp_removed in zip(model.model.layers, plan.attn_removed, plan.mlp_removed):
            at, mlp = layer.self_attn, layer.mlp
            if cfg.model_type == "olmo2" and attn_removed:
                gone = set(attn_removed)
                at.q_norm = kept_rows_rms_norm(at.q_norm, [i for i in range(at.q_proj.out_features)
                                                           if i // (rep * d) not in gone])
                at.k_norm = kept_rows_rms_norm(at.k_norm, [i for i in range(at.k_proj.out_features)
                                                           if i // d not in gone])
            for g in attn_removed:
                q, kv = slice(g * rep * d, (g + 1) * rep * d), slice(g * d, (g + 1) * d)
                for proj, rows in ((at.q_proj, q), (at.k_proj, kv), (at.v_proj, kv)):
                    proj.weight[rows] = 0
                    if proj.bias is not None:
                        proj.bias[rows] = 0
                at.o_proj.weight[:, q] = 0
            for c in mlp_removed:
                mlp.gate_proj.weight[c] = 0
                mlp.up_proj.weight[c] = 0
                mlp.down_proj.weight[:, c] = 0
    return model


def write_lm_eval_task(task: str, data_file: Path, folder: Path, name: str | None = None) -> str:
    """A task YAML for lm-eval's own CLI (`--include_path folder --tasks NAME`): lm-eval's registered definition
    of `task` by `include:`, with only its data source replaced, as `offline_task_config` does in memory."""
    import yaml

    from taylor_tune.evaluation.zero_shot import TASK_YAML, _lm_eval_tasks_dir, offline_task_config

    name = name or f"{task}_offline"
    source = offline_task_config(task, data_file)
    override = {k: source[k] for k in ("dataset_path", "dataset_name", "dataset_kwargs", "training_split",
                                        "validation_split", "test_split", "fewshot_split")}
    folder.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump({"include": str(_lm_eval_tasks_dir() / TASK_YAML[task]), "task": name, "tag": [], **override})
    (folder / f"{name}.yaml").write_text(text)
    return name


def llama(**extra):
    """A three-layer Llama built from its config (GQA, head_dim 8), with `extra` config fields such as
    attention_bias, mlp_bias, tie_word_embeddings or another num_hidden_layers: the layouts no shipped tiny model
    has."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**dict(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8) | extra)
    return LlamaForCausalLM(config).eval()


def record_loads(monkeypatch, *modules) -> list[tuple[str, str, dict]]:
    """Every `load_model` call made through each module's own name, as (module name, model, keyword arguments); the
    real load still runs. A test compares two loads' arguments (the unpruned model a trial times or distils from is
    loaded as the trial's own model)."""
    loads = []
    for module in modules:
        real = module.load_model
        monkeypatch.setattr(module, "load_model", lambda spec, real=real, name=module.__name__, **kwargs:
                            loads.append((name, spec, kwargs)) or real(spec, **kwargs))
    return loads
