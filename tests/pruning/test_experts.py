"""Issue 93: expert pruning of the mixtures of experts (Qwen3-MoE, Mixtral, OLMoE, Granite-MoE).

- pruned equals masked: removing experts computes what the unpruned model computes with those experts' router logits
  at -inf before its routing (the model's own `F.linear` of the router masked), to 1e-5 in float32, per family and
  for Qwen3-MoE with `norm_topk_prob` both ways;
- each criterion equals a computation of its own here: frequency, reap and ean from the routers' outputs (hooks on
  transformers' routers: logits, top-k, gates) and each routed token's expert output written out from the expert's
  weights; taylor from one autograd gradient of the mean loss over every calibration row at once;
- the plan removes the same count of the lowest-scored experts from every sparse layer, and refuses what would
  leave fewer experts than a token is routed to; the pruned model reloads in stock transformers with equal logits."""

import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from taylor_tune.errors import PlanError
from taylor_tune.pruning.apply import apply_plan, save_pruned
from taylor_tune.pruning.experts import expert_scores
from taylor_tune.pruning.groups import describe_layout, expert_parameters, sparse_blocks
from taylor_tune.pruning.methods import PlanOptions
from taylor_tune.pruning.methods.experts import plan_experts
from taylor_tune.pruning.plan import PrunePlan
from taylor_tune.sources.families import FAMILIES, MIXTURES
from tests.helpers import tiny

MOE_MODELS = {"qwen3_moe": "tiny-qwen3moe-random", "mixtral": "tiny-mixtral-random", "olmoe": "tiny-olmoe-random",
              "granitemoe": "tiny-granitemoe-random"}
CASES = [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", None), ("olmoe", None), ("granitemoe", None)]


def mixture(model_type: str, norm_topk_prob: bool | None = None, seed: int = 0):
    model = tiny(MOE_MODELS[model_type], seed=seed)
    if norm_topk_prob is not None:
        model.config.norm_topk_prob = norm_topk_prob
        for block in sparse_blocks(model).values():
            block.gate.norm_topk_prob = norm_topk_prob
    return model


def ids(rows: int = 6, length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 250, (rows, length), generator=torch.Generator().manual_seed(seed))


class MaskedRouters:
    """torch.nn.functional as the modeling module sees it, but the routers' logits of the removed experts -inf."""

    def __init__(self, removed: dict[int, tuple[int, ...]]):
        self.removed = removed  # id(router weight) -> its removed experts

    def linear(self, x, weight, bias=None):
        out = F.linear(x, weight, bias)
        gone = self.removed.get(id(weight))
        if gone:
            out = out.clone()
            out[..., list(gone)] = -torch.inf
        return out

    def __getattr__(self, name):
        return getattr(F, name)


def removal(model, count: int, seed: int) -> tuple[tuple[int, ...], ...]:
    rng = np.random.default_rng(seed)
    blocks = sparse_blocks(model)
    experts = describe_layout(model).experts
    return tuple(tuple(sorted(rng.choice(experts[i], count, replace=False).tolist())) if i in blocks else ()
                 for i in range(len(model.model.layers)))


@pytest.mark.parametrize(("model_type", "norm_topk_prob"), CASES)
def test_removing_experts_equals_masking_their_router_logits(model_type, norm_topk_prob, monkeypatch):
    model = mixture(model_type, norm_topk_prob)
    moe, tokens = FAMILIES[model_type].experts, ids()
    removed = removal(model, 3, seed=1)
    routers = {i: getattr(block, moe.router) for i, block in sparse_blocks(model).items()}
    assert len({removed[i] for i in routers}) > 1  # different experts go in different layers
    masked_f = MaskedRouters({id(router.weight): removed[i] for i, router in routers.items()})
    modeling = sys.modules[type(model).__module__]
    with torch.no_grad():
        before = model(tokens).logits
        monkeypatch.setattr(modeling, "F", masked_f)
        masked = model(tokens).logits
        monkeypatch.undo()
    assert (masked - before).abs().max() > 2e-4  # the masked experts mattered: 20 x the tolerance below
    layout = describe_layout(model)
    plan = PrunePlan("experts", ((),) * layout.num_layers, ((),) * layout.num_layers, experts_removed=removed)
    plan.validate(layout)
    apply_plan(model, plan)
    assert getattr(model.config, moe.count) == 5
    with torch.no_grad():
        pruned = model(tokens).logits
    torch.testing.assert_close(pruned, masked, rtol=1e-5, atol=1e-5)


def reference_routing(model, tokens: torch.Tensor):
    """Per sparse layer: how often each expert was chosen and the sums of gate x ‖output‖ and ‖output‖ over the
    tokens routed to it, from the routers' own outputs (hooked) and each expert's output written out here."""
    moe = FAMILIES[model.config.model_type].experts
    seen = {}
    hooks = []
    for i, block in sparse_blocks(model).items():
        def keep(module, args, output, i=i):
            seen.setdefault(i, []).append((args[0].detach(), output[1].detach(), output[2].detach()))
        hooks.append(getattr(block, moe.router).register_forward_hook(keep))
    with torch.no_grad():
        for row in tokens:  # one sequence at a time
            model(row[None])
    for hook in hooks:
        hook.remove()
    out = {}
    for i, calls in seen.items():
        experts = sparse_blocks(model)[i].experts
        count = experts.gate_up_proj.shape[0]
        chosen, gated, norms = np.zeros(count), np.zeros(count), np.zeros(count)
        for hidden, gates, index in calls:
            for t in range(hidden.shape[0]):
                for k in range(index.shape[1]):
                    e = int(index[t, k])
                    with torch.no_grad():
                        gate, up = (experts.gate_up_proj[e] @ hidden[t]).chunk(2)
                        value = float((experts.down_proj[e] @ (experts.act_fn(gate) * up)).norm())
                    chosen[e] += 1
                    gated[e] += float(gates[t, k]) * value
                    norms[e] += value
        out[i] = chosen, gated, norms
    return out


@pytest.mark.parametrize(("model_type", "norm_topk_prob"), CASES)
def test_frequency_reap_and_ean_equal_the_routers_outputs_and_each_experts_output(model_type, norm_topk_prob):
    model, tokens = mixture(model_type, norm_topk_prob), ids(rows=5, length=12)
    reference = reference_routing(model, tokens)
    total = tokens.numel()
    layers = len(model.model.layers)
    for criterion in ("frequency", "reap", "ean"):
        got = expert_scores(model, tokens, criterion, micro_batch_size=2)  # batches that do not divide the rows
        for i in range(layers):
            if i not in reference:
                assert len(got[i]) == 0  # a dense layer (Qwen3-MoE's mlp_only_layers)
                continue
            chosen, gated, norms = reference[i]
            want = {"frequency": chosen / total, "reap": gated / np.maximum(chosen, 1),
                    "ean": norms / np.maximum(chosen, 1)}[criterion]
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-9)
    chosen = reference[next(iter(reference))][0]
    assert chosen.sum() == total * model.config.num_experts_per_tok and len(set(chosen)) > 1


@pytest.mark.parametrize(("model_type", "norm_topk_prob"), CASES)
def test_expert_taylor_equals_one_autograd_gradient_of_the_mean_loss(model_type, norm_topk_prob):
    model, tokens = mixture(model_type, norm_topk_prob), ids(rows=5, length=12)
    got = expert_scores(model, tokens, "taylor", micro_batch_size=2)
    moe = FAMILIES[model_type].experts
    blocks = sparse_blocks(model)
    params = {i: expert_parameters(block, moe.router) for i, block in blocks.items()}
    flat = [p for ps in params.values() for p in ps]
    loss = model(input_ids=tokens, labels=tokens).loss  # every row at once: the mean loss
    grads = dict(zip(map(id, flat), torch.autograd.grad(loss, flat)))
    for i in range(len(model.model.layers)):
        if i not in blocks:
            assert len(got[i]) == 0
            continue
        count = blocks[i].experts.gate_up_proj.shape[0]
        want = np.zeros(count)
        for e in range(count):
            terms = [float((p[e].detach() * grads[id(p)][e]).abs().sum()) for p in params[i]]
            want[e] = sum(terms) / sum(p[e].numel() for p in params[i])
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-12)
        assert (want > 0).all()


def options(expert_sparsity: float) -> PlanOptions:
    return PlanOptions(sparsity=0.2, layerwise_max_ratio=0.4, blockwise_layer_start=None, blockwise_layer_end=None,
                       blockwise_attention="mlp_only", criterion="taylor", seed=0, expert_sparsity=expert_sparsity)


def test_the_plan_removes_the_same_count_of_the_lowest_experts_from_every_sparse_layer():
    layout = describe_layout(mixture("qwen3_moe"))
    assert layout.experts == (8, 8, 0, 8) and layout.top_k == 2  # layer 2 is dense (mlp_only_layers)
    scores = (np.arange(8.0)[::-1], np.array([5, 1, 1, 7, 0, 9, 2, 3.0]), np.zeros(0), np.ones(8))
    plan = plan_experts(scores, layout, options(0.3))  # 2.4 experts: the nearest count, 2, from each layer
    assert plan.experts_removed == ((6, 7), (1, 4), (), (0, 1))  # ties by index
    assert plan_experts(scores, layout, options(0.01)).experts_removed[0] == (7,)  # at least one
    assert plan.layer_params_removed(layout) == [2 * layout.expert_params] * 2 + [0] + [2 * layout.expert_params]
    assert plan.active_params_after(layout) == layout.active_params  # a token still computes with 2 experts
    assert all(len(r) == 6 for r in plan_experts(scores, layout, options(0.75)).experts_removed if r)  # 2 stay
    with pytest.raises(PlanError, match=r"expert_sparsity: 0.9 removes 7 of 8 experts, leaving fewer than the 2 "
                                        r"each token is routed to; at most 0.75"):
        plan_experts(scores, layout, options(0.9))
    with pytest.raises(PlanError, match="keeps 1 of 8 experts, fewer than the 2"):
        PrunePlan("experts", plan.attn_removed, plan.mlp_removed,
                  experts_removed=((0, 1, 2, 3, 4, 5, 6), (), (), ())).validate(layout)


def test_a_pruned_mixture_reloads_in_stock_transformers_with_equal_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    model, tokens = mixture("qwen3_moe"), ids()
    layout = describe_layout(model)
    plan = plan_experts(expert_scores(model, tokens, "reap", 4), layout, options(0.5))
    apply_plan(model, plan)
    with torch.no_grad():
        expected = model(tokens).logits
    save_pruned(model, tmp_path / "pruned", source_model="tiny-qwen3moe-random")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned")
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM" and reloaded.config.num_experts == 4
    assert reloaded.config.mlp_only_layers == [2] and reloaded.config.norm_topk_prob is True
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, rtol=1e-5, atol=1e-5)
    assert describe_layout(reloaded).total_params == layout.total_params - sum(plan.layer_params_removed(layout))


def test_every_mixture_family_is_declared_with_its_tiny_model():
    assert set(MIXTURES) == set(MOE_MODELS)
    for model_type in MIXTURES:
        model = mixture(model_type)
        layout = describe_layout(model)
        assert set(layout.experts) - {0} == {8} and layout.top_k == 2
        assert layout.active_params < layout.total_params
