"""Expert pruning of a mixture of experts: how much each expert matters over the calibration tokens, and its removal.

Expert e of a sparse block is index e of its router's weight (one logit per expert) and of its experts' stacked
`gate_up_proj` / `down_proj` (`groups.expert_parameters`). The criteria (`config.EXPERT_CRITERIA`):
- frequency: the share of the calibration tokens whose top-k holds it;
- reap (REAP, Lasby et al., ICLR 2026): the mean, over the tokens routed to it, of its gate (the weight the block
  multiplies its output by: renormalised where the family renormalises) times the L2 norm of its output;
- ean: the mean norm of its output over the same tokens (REAP without the gate);
- taylor: Σ|w·ḡ| over its parameters divided by their count, ḡ the gradient of the mean calibration loss
  (`importance`'s definition): the dense methods' criterion with the expert as the group.
An expert no calibration token reaches scores 0 under the first three, so it goes first.

`remove_experts` drops the removed experts' router rows and weights and lowers the config's count: the router's top-k
then chooses among the kept experts, so the pruned model computes what the unpruned one does with the removed
experts' logits at -inf (tests/pruning/test_experts.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from taylor_tune.errors import PlanError
from taylor_tune.progress import bar
from taylor_tune.pruning.groups import decoder_layers, expert_parameters, experts_of, kept, sparse_blocks
from taylor_tune.pruning.importance import gradient_sums

ExpertScores = tuple  # per decoder layer, one score per expert (an empty array for a dense layer); higher matters more


@dataclass(frozen=True)
class Routing:
    """What the calibration tokens did in each sparse layer: per expert, how many tokens chose it, and the sums over
    those tokens of its gate x its output's norm and of its output's norm."""

    tokens: int
    selected: dict[int, np.ndarray]
    gated_norm: dict[int, np.ndarray]
    norm: dict[int, np.ndarray]

    def scores(self, criterion: str, num_layers: int) -> ExpertScores:
        by_layer = {}
        for layer, selected in self.selected.items():
            routed = np.maximum(selected, 1)  # an expert no token reached: 0 / 1
            by_layer[layer] = {"frequency": selected / max(self.tokens, 1), "reap": self.gated_norm[layer] / routed,
                               "ean": self.norm[layer] / routed}[criterion]
        return tuple(by_layer.get(i, np.zeros(0)) for i in range(num_layers))


def routing(model: nn.Module, input_ids: torch.Tensor, micro_batch_size: int = 8) -> Routing:
    """One forward pass over the calibration rows, each sparse block's experts watched: their inputs are the
    block's routing (hidden states, each token's top-k experts and gates), and each routed (token, expert) pair's
    output is computed again by the experts module itself with that expert alone at gate 1."""
    blocks = sparse_blocks(model)
    sums = {i: torch.zeros(3, block.experts.gate_up_proj.shape[0], dtype=torch.float64)
            for i, block in blocks.items()}

    def watch(layer: int):
        def record(module, args, output) -> None:
            hidden, index, gates = args[:3]
            chosen = index.reshape(-1)
            rows = hidden.repeat_interleave(index.shape[-1], dim=0)  # token t's row once per expert of its top-k
            alone = module.forward(rows, chosen[:, None], torch.ones(len(chosen), 1, dtype=rows.dtype,
                                                                    device=rows.device))
            norms = alone.float().norm(dim=-1).double().cpu()
            chosen = chosen.cpu()
            sums[layer][0].index_add_(0, chosen, torch.ones_like(norms))
            sums[layer][1].index_add_(0, chosen, gates.reshape(-1).double().cpu() * norms)
            sums[layer][2].index_add_(0, chosen, norms)
        return record

    device = next(model.parameters()).device
    hooks = [block.experts.register_forward_hook(watch(i)) for i, block in blocks.items()]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), bar(input_ids.numel(), "routing", unit="tok", unit_scale=True) as progress:
            for start in range(0, input_ids.shape[0], micro_batch_size):
                batch = input_ids[start : start + micro_batch_size].to(device)
                model(input_ids=batch, use_cache=False)
                progress.update(batch.numel())
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return Routing(input_ids.numel(), {i: s[0].numpy() for i, s in sums.items()},
                   {i: s[1].numpy() for i, s in sums.items()}, {i: s[2].numpy() for i, s in sums.items()})


def expert_taylor(model: nn.Module, input_ids: torch.Tensor, micro_batch_size: int = 8) -> ExpertScores:
    """Each expert's Σ|w·ḡ| / (its parameter count) over its router row and its weights, ḡ the gradient of the mean
    loss over the calibration rows, accumulated micro-batch by micro-batch in fp32 buffers (as `importance`'s
    pass: each `.grad` freed as soon as it is added)."""
    blocks, moe = sparse_blocks(model), experts_of(model)
    params = {i: expert_parameters(block, moe.router) for i, block in blocks.items()}
    device, total = next(model.parameters()).device, input_ids.shape[0]
    with gradient_sums(model, [p for ps in params.values() for p in ps]) as buffers, \
            bar(input_ids.numel(), "importance", unit="tok", unit_scale=True) as progress:
        for start in range(0, total, micro_batch_size):
            batch = input_ids[start : start + micro_batch_size].to(device)
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            (loss * batch.shape[0]).backward()  # Σ over samples of each sample's mean token loss
            progress.update(batch.numel())
    scores = {}
    with torch.no_grad():
        for layer, ps in params.items():
            sums = sum((p.float() * buffers[p]).abs_().div_(total).reshape(len(p), -1).sum(dim=1) for p in ps)
            scores[layer] = (sums / sum(p[0].numel() for p in ps)).double().cpu().numpy()
    return tuple(scores.get(i, np.zeros(0)) for i in range(len(decoder_layers(model))))


def expert_scores(model: nn.Module, input_ids: torch.Tensor, criterion: str, micro_batch_size: int = 8) -> ExpertScores:
    """The experts' scores by `criterion` (`config.EXPERT_CRITERIA`) over the calibration rows."""
    if criterion == "taylor":
        return expert_taylor(model, input_ids, micro_batch_size)
    return routing(model, input_ids, micro_batch_size).scores(criterion, len(decoder_layers(model)))


def remove_experts(model: nn.Module, removed: tuple[tuple[int, ...], ...]) -> nn.Module:
    """The experts `removed` (per decoder layer) gone from `model`, in place: their router rows, their weights, and
    the config's count (every sparse layer must keep as many, or no config says the model)."""
    moe, blocks = experts_of(model), sparse_blocks(model)
    counts = set()
    for layer, block in blocks.items():
        router, experts = getattr(block, moe.router), block.experts
        keep = kept(len(router.weight), removed[layer]).to(router.weight.device)
        router.weight = nn.Parameter(router.weight.detach().index_select(0, keep), router.weight.requires_grad)
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name)
            setattr(experts, name, nn.Parameter(weight.detach().index_select(0, keep), weight.requires_grad))
        for module in (router, experts):  # what their forwards size the routing by
            if hasattr(module, "num_experts"):
                module.num_experts = len(keep)
        counts.add(len(keep))
    if len(counts) > 1:
        raise PlanError(f"experts: the sparse layers would keep {sorted(counts)} experts; a mixture's config holds "
                        "one count for every layer, so each must keep the same")
    if counts:
        setattr(model.config, moe.count, counts.pop())
    return model
