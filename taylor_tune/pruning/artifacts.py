"""Write what one pruning run leaves behind: pruning_summary.json, importance.safetensors, model/."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from taylor_tune.config import PruneConfig
from taylor_tune.jsonio import write_json
from taylor_tune.pruning.apply import save_pruned
from taylor_tune.pruning.prune import PruneResult, summary_dict


def importance_tensors(result: PruneResult) -> dict[str, torch.Tensor]:
    """Group scores, gradient statistics and the calibration tokens, for audit and reproduction."""
    tensors: dict[str, torch.Tensor] = {}
    if result.importance is not None:
        scores = result.importance.scores
        for layer, (a, m) in enumerate(zip(scores.attn, scores.mlp)):
            tensors[f"layers.{layer}.attention_scores"] = torch.from_numpy(a.copy())
            tensors[f"layers.{layer}.mlp_scores"] = torch.from_numpy(m.copy())
        tensors["layer_grad_mean"] = torch.from_numpy(result.importance.grad_mean.copy())
        tensors["layer_grad_norm"] = torch.from_numpy(result.importance.grad_norm.copy())
    if result.plan is not None and result.plan.experts_removed:  # a mixture: each sparse layer's expert scores
        for layer, scores in enumerate(result.scores):
            if len(scores):
                tensors[f"layers.{layer}.expert_scores"] = torch.from_numpy(np.asarray(scores, dtype=np.float64))
    if result.calibration_ids is not None:
        tensors["calibration_input_ids"] = result.calibration_ids.contiguous()
    return tensors


def write_prune_artifacts(output: str | Path, config: PruneConfig, result: PruneResult) -> Path:
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    write_json(output / "pruning_summary.json", summary_dict(config, result))
    metadata = {"method": config.method, "num_samples": str(config.num_samples), "seq_len": str(config.seq_len),
                "seed": str(config.seed), "calibration": config.calibration, "model": config.model}
    save_file(importance_tensors(result), str(output / "importance.safetensors"), metadata=metadata)
    if result.streamed:  # written layer by layer by the pruning itself
        result.tokenizer.save_pretrained(result.pruned_folder)
    else:
        save_pruned(result.model, output / "model", tokenizer=result.tokenizer, source_model=config.model)
    return output
