"""Group scores against an independent brute force: full autograd gradient of the mean loss, then loops."""

import copy
import dataclasses

import numpy as np
import pytest
import torch

from taylor_tune.pruning.groups import describe_layout, prunable_parameters, reduce_to_groups
from taylor_tune.pruning.importance import check_importance, compute_importance, magnitude_scores
from taylor_tune.pruning.plan import GroupScores
from tests.helpers import calibration_ids, head_dim_of, llama, tiny


def brute_force(model, ids, normalize: bool = True):
    """Scores by the definition, written without the library's grouping code: one group at a time. With
    `normalize` False, the plain group sums (the taylor_sum criterion)."""
    model = copy.deepcopy(model)
    for p in model.parameters():
        p.requires_grad_(True)
        p.grad = None
    model(input_ids=ids, labels=ids).loss.backward()  # mean over every token of every sample
    torch.set_grad_enabled(False)
    try:
        return _group_by_loops(model, normalize)
    finally:
        torch.set_grad_enabled(True)


def _group_by_loops(model, normalize=True):
    cfg = model.config
    d, rep = head_dim_of(cfg), cfg.num_attention_heads // cfg.num_key_value_heads
    attn_scores, mlp_scores, grad_mean, grad_norm = [], [], [], []
    for layer in model.model.layers:
        at, mlp = layer.self_attn, layer.mlp
        sal = lambda m: (m.weight * m.weight.grad).abs()
        sal_b = lambda m: (m.bias * m.bias.grad).abs() if m.bias is not None else None
        groups = []
        for g in range(cfg.num_key_value_heads):
            q = slice(g * rep * d, (g + 1) * rep * d)
            kv = slice(g * d, (g + 1) * d)
            total = (
                sal(at.q_proj)[q].sum()
                + sal(at.k_proj)[kv].sum()
                + sal(at.v_proj)[kv].sum()
                + sal(at.o_proj)[:, q].sum()
            )
            count = at.q_proj.weight[q].numel() + 2 * at.k_proj.weight[kv].numel() + at.o_proj.weight[:, q].numel()
            for proj, rows in ((at.q_proj, q), (at.k_proj, kv), (at.v_proj, kv)):
                if proj.bias is not None:
                    total = total + sal_b(proj)[rows].sum()
                    count += proj.bias[rows].numel()
            if cfg.model_type == "olmo2":  # its q_norm / k_norm entries of the group's rows are the group's
                total = total + sal(at.q_norm)[q].sum() + sal(at.k_norm)[kv].sum()
                count += rep * d + d
            groups.append(float(total) / (count if normalize else 1))
        attn_scores.append(np.array(groups))
        channels = []
        gate, up, down = (
            sal(mlp.gate_proj),
            sal(mlp.up_proj),
            sal(mlp.down_proj),
        )  # once per layer: a real MLP has thousands of channels
        biases = [sal_b(p) for p in (mlp.gate_proj, mlp.up_proj) if p.bias is not None]  # Llama's mlp_bias
        for c in range(mlp.gate_proj.out_features):
            total = gate[c].sum() + up[c].sum() + down[:, c].sum() + sum(b[c] for b in biases)
            channels.append(float(total) / (3 * mlp.gate_proj.in_features + len(biases) if normalize else 1))
        mlp_scores.append(np.array(channels))
        grads = [
            p.grad.flatten()
            for m in (at.q_proj, at.k_proj, at.v_proj, at.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
            for p in (m.weight, m.bias)
            if p is not None and not (m in (at.o_proj, mlp.down_proj) and p is m.bias)  # output biases: no group's
        ] + ([at.q_norm.weight.grad, at.k_norm.weight.grad] if cfg.model_type == "olmo2" else [])
        flat = torch.cat(grads).double()  # fp64: an fp32 norm over millions of entries (a real layer) is off by ~1e-3
        grad_mean.append(float(flat.abs().mean()))
        grad_norm.append(float(flat.norm()))
    return attn_scores, mlp_scores, np.array(grad_mean), np.array(grad_norm)


def assert_scores_close(ours, attn, mlp):
    for a, b in zip(ours.attn, attn):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-12)
    for a, b in zip(ours.mlp, mlp):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-12)


def test_scores_equal_brute_force_and_snapshots_equal_separate_runs(arch):
    model = tiny(arch)
    layout = describe_layout(model)
    ids = calibration_ids(12, 16)
    # micro-batch 5 does not divide the snapshot boundary 4 nor 12: the pass must split at boundaries
    nested = compute_importance(model, layout, ids, micro_batch_size=5, snapshots=[4, 12])
    for n in (4, 12):
        attn, mlp, gmean, gnorm = brute_force(model, ids[:n])
        assert_scores_close(nested[n].scores, attn, mlp)
        np.testing.assert_allclose(nested[n].grad_mean, gmean, rtol=1e-5)
        np.testing.assert_allclose(nested[n].grad_norm, gnorm, rtol=1e-5)
    separate = compute_importance(model, layout, ids[:4], micro_batch_size=3)[4]
    assert_scores_close(separate.scores, nested[4].scores.attn, nested[4].scores.mlp)


def test_qwen2_biases_count_in_the_attention_groups():
    model = tiny("tiny-qwen2-random")
    layout = describe_layout(model)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    cfg = model.config
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    # q (rep*d rows) + k + v (d rows each) of hidden inputs, o_proj's rep*d columns, and the three biases
    expected = (2 * rep * cfg.head_dim + 2 * cfg.head_dim) * cfg.hidden_size + (rep + 2) * cfg.head_dim
    assert layout.attn_group_params == expected


def test_pass_leaves_no_gradients_and_restores_flags():
    model = tiny("tiny-llama-random")
    model.lm_head.weight.requires_grad_(False)  # a flag the caller chose must survive
    compute_importance(model, describe_layout(model), calibration_ids(4, 8), micro_batch_size=2)
    assert all(p.grad is None for p in model.parameters())
    assert model.model.embed_tokens.weight.requires_grad and not model.lm_head.weight.requires_grad
    assert not model.training


@pytest.mark.parametrize("p", [1, 2])
def test_magnitude_scores_are_mean_absolute_or_squared_weights(p):
    model = tiny("tiny-qwen2-random")  # q/k/v biases belong to their attention group too
    scores = magnitude_scores(model, describe_layout(model), p=p)
    layer = model.model.layers[1]
    mlp, attn, c = layer.mlp, layer.self_attn, 7
    norm = lambda t: float(t.detach().abs().pow(p).sum())
    expected = (norm(mlp.gate_proj.weight[c]) + norm(mlp.up_proj.weight[c]) + norm(mlp.down_proj.weight[:, c])) / (
        3 * mlp.gate_proj.in_features
    )
    assert scores.mlp[1][c] == pytest.approx(expected, rel=1e-5)
    # attention group g: its KV head's k/v rows, the q rows of the query heads it serves, and those o_proj columns
    d, rep, g = attn.head_dim, attn.config.num_attention_heads // attn.config.num_key_value_heads, 1
    q, kv = slice(g * rep * d, (g + 1) * rep * d), slice(g * d, (g + 1) * d)
    parts = [attn.q_proj.weight[q], attn.q_proj.bias[q], attn.k_proj.weight[kv], attn.k_proj.bias[kv],
             attn.v_proj.weight[kv], attn.v_proj.bias[kv], attn.o_proj.weight[:, q]]
    assert scores.attn[1][g] == pytest.approx(sum(map(norm, parts)) / sum(t.numel() for t in parts), rel=1e-5)
    if p == 2:  # the documented default is the l2 criterion
        default = magnitude_scores(model, describe_layout(model))
        assert all(np.array_equal(a, b) for a, b in zip(default.attn + default.mlp, scores.attn + scores.mlp))


@pytest.mark.parametrize(
    "method, criterion", [("blockwise", "l2"), ("blockwise", "l1"), ("magnitude", "l1"), ("layerwise", "l2")]
)
def test_magnitude_criteria_plan_from_weights_without_calibration(method, criterion):
    from taylor_tune.config import build_prune_config
    from taylor_tune.pruning.methods import METHODS, PlanOptions
    from taylor_tune.pruning.prune import prune

    # blockwise's default attention rule measures a calibration loss; min_loss keeps it weights-only
    config = build_prune_config(dict(model="tiny-llama", method=method, criterion=criterion, sparsity=0.3, device="cpu",
                                     dtype="float32", blockwise_attention="min_loss"))
    result = prune(config)
    assert result.importance is None and result.calibration_ids is None and "calibration_s" not in result.timings
    weights = magnitude_scores(tiny("tiny-llama"), result.layout, p=int(criterion[1]))
    assert result.plan == METHODS[method].plan(weights, result.layout, PlanOptions.of(config))


def test_snapshot_outside_the_draw_is_rejected():
    model = tiny("tiny-llama-random")
    with pytest.raises(ValueError, match="snapshots"):
        compute_importance(model, describe_layout(model), calibration_ids(4, 8), snapshots=[8])


def test_taylor_sum_criterion_is_the_plain_group_sum(arch):
    from taylor_tune.pruning.importance import taylor_criterion

    model = tiny(arch)
    layout = describe_layout(model)
    ids = calibration_ids(6, 16)
    ours = compute_importance(model, layout, ids, micro_batch_size=3)[6].scores
    attn, mlp, _, _ = brute_force(model, ids, normalize=False)
    assert_scores_close(taylor_criterion(ours, layout, "taylor_sum"), attn, mlp)
    assert taylor_criterion(ours, layout, "taylor") is ours


def test_prune_ranks_by_the_configured_criterion():
    from taylor_tune.config import build_prune_config
    from taylor_tune.pruning.importance import taylor_criterion
    from taylor_tune.pruning.methods import METHODS, PlanOptions
    from taylor_tune.pruning.prune import prune

    plans = {}
    for criterion in ("taylor", "taylor_sum"):
        config = build_prune_config(
            dict(
                model="tiny-llama",
                method="taylor",
                criterion=criterion,
                sparsity=0.5,
                seq_len=32,
                num_samples=8,
                calibration="world",
                device="cpu",
                dtype="float32",
            )
        )
        result = prune(config)
        expected = METHODS["taylor"].plan(taylor_criterion(result.importance.scores, result.layout, criterion),
                                          result.layout, PlanOptions.of(config))
        assert result.plan == expected
        plans[criterion] = result.plan
    # the sum favours the larger groups (attention groups), so here it removes none of them; the mean removes one
    removed = {c: sum(map(len, p.attn_removed)) for c, p in plans.items()}
    assert removed == {"taylor": 1, "taylor_sum": 0}


@pytest.fixture(scope="module")
def real_pass():
    """(layout, importance) of a real two-sample pass: one for every test that spoils a copy of it."""
    model = tiny("tiny-llama-random")
    layout = describe_layout(model)
    return layout, compute_importance(model, layout, calibration_ids(2, 8), micro_batch_size=2)[2]


@pytest.mark.parametrize("part", ["attention scores", "MLP scores", "layer_grad_mean", "layer_grad_norm"])
@pytest.mark.parametrize("bad", [float("nan"), -1e-9, float("inf")])
def test_check_importance_names_the_part_that_is_not_a_mean_of_absolute_values(part, bad, real_pass):
    layout, good = real_pass
    check_importance(good, layout)  # a real pass is accepted
    spoil = lambda arrays, i: tuple(np.where(np.arange(len(a)) == 0, bad, a) if j == i else a
                                    for j, a in enumerate(arrays))
    layer = layout.num_layers - 1  # any layer, not only the first
    changed = {
        "attention scores": lambda: dataclasses.replace(good, scores=GroupScores(spoil(good.scores.attn, layer),
                                                                                 good.scores.mlp)),
        "MLP scores": lambda: dataclasses.replace(good, scores=GroupScores(good.scores.attn,
                                                                           spoil(good.scores.mlp, layer))),
        "layer_grad_mean": lambda: dataclasses.replace(good, grad_mean=spoil((good.grad_mean,), 0)[0]),
        "layer_grad_norm": lambda: dataclasses.replace(good, grad_norm=spoil((good.grad_norm,), 0)[0]),
    }[part]()
    with pytest.raises(ValueError) as error:
        check_importance(changed, layout)
    others = {"attention scores", "MLP scores", "layer_grad_mean", "layer_grad_norm"} - {part}
    assert part in str(error.value) and not any(o in str(error.value) for o in others)
    assert "at 2 samples" in str(error.value)


def test_check_importance_rejects_statistics_for_another_layer_count(real_pass):
    layout, good = real_pass
    n = layout.num_layers
    for field, counts in (("grad_mean", f"{n - 1}/{n}"), ("grad_norm", f"{n}/{n - 1}")):
        short = dataclasses.replace(good, **{field: getattr(good, field)[:-1]})
        with pytest.raises(ValueError, match=f"for {counts} layers, the model has {n}"):
            check_importance(short, layout)


def test_a_zero_score_is_accepted_only_a_negative_or_non_finite_one_refused(real_pass):
    layout, good = real_pass
    zero = GroupScores(tuple(np.zeros_like(a) for a in good.scores.attn), good.scores.mlp)
    check_importance(dataclasses.replace(good, scores=zero, grad_mean=good.grad_mean * 0), layout)


def test_snapshots_must_lie_between_one_sample_and_all_of_them():
    model = tiny("tiny-llama-random")
    layout = describe_layout(model)
    ids = calibration_ids(3, 8)
    one = compute_importance(model, layout, ids, snapshots=[1, 3])[1]  # one sample is a draw too
    attn, mlp, _, _ = brute_force(model, ids[:1])
    assert_scores_close(one.scores, attn, mlp)
    for snapshots in ([0, 2], [-1], [4], [2, 4]):
        with pytest.raises(ValueError, match=r"must lie in \[1, 3\]"):
            compute_importance(model, layout, ids, snapshots=snapshots)


def test_a_bf16_models_gradients_accumulate_in_fp32():
    """Over 16 micro-batches of one sample, bf16 running sums would drift (~1e-4 of the largest score here); fp32
    sums equal the float64 sum of the same per-sample bf16 gradients."""
    model = tiny("tiny-llama-random").to(torch.bfloat16)
    layout = describe_layout(model)
    ids = calibration_ids(16, 16)
    ours = compute_importance(model, layout, ids, micro_batch_size=1)[16].scores
    reference = copy.deepcopy(model)
    sums = {name: 0 for name, _ in reference.named_parameters()}
    for i in range(16):
        reference.zero_grad(set_to_none=True)
        reference(input_ids=ids[i : i + 1], labels=ids[i : i + 1]).loss.backward()
        for name, p in reference.named_parameters():
            sums[name] = sums[name] + p.grad.double()
    names = {id(p): name for name, p in reference.named_parameters()}
    with torch.no_grad():
        attn, mlp = reduce_to_groups(reference, lambda _, p: (p.double() * sums[names[id(p)]]).abs() / 16)
    for kind, got, want, size in (("attn", ours.attn, attn, layout.attn_group_params),
                                  ("mlp", ours.mlp, mlp, layout.mlp_channel_params)):
        for g, w in zip(got, want):
            w = w.double().numpy() / size
            assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max(), kind


def test_no_gradient_reaches_embeddings_norms_or_the_head():
    model = tiny("tiny-qwen2-random")
    grouped = {id(p) for params in prunable_parameters(model) for _, p in params}
    reached = []
    for name, p in model.named_parameters():
        if id(p) not in grouped:
            p.register_post_accumulate_grad_hook(lambda _, name=name: reached.append(name))
    compute_importance(model, describe_layout(model), calibration_ids(2, 8), micro_batch_size=1)
    assert reached == [] and len(grouped) < len(list(model.parameters()))


def test_the_progress_bar_counts_the_calibration_tokens(monkeypatch, capsys):
    import functools

    import taylor_tune.progress

    monkeypatch.setenv("TAYLOR_TUNE_PROGRESS", "1")
    # every update drawn: tqdm skips those within 0.1 s of the last, so the final count would show only on slow runs
    monkeypatch.setattr(taylor_tune.progress, "tqdm",
                        functools.partial(taylor_tune.progress.tqdm, mininterval=0, miniters=1))
    model, ids = tiny("tiny-llama-random"), calibration_ids(3, 8)
    capsys.readouterr()  # the calibration draw's own bar
    compute_importance(model, describe_layout(model), ids, micro_batch_size=2)
    # tqdm pads a line with spaces to the length of the one it overwrites: a faster rate is a shorter line
    lines = [line.rstrip() for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if line.strip()]
    assert lines and all(line.startswith("importance: ") for line in lines)
    final = lines[-1]  # 3 sequences of 8 tokens, micro-batches of 2 then 1: 16 then 24 tokens
    assert "| 24.0/24.0 [" in final and final.endswith("tok/s]") and lines[-2].split("|")[2].startswith(" 16.0/24.0")


def test_the_gradient_pass_builds_no_kv_cache():
    """A KV cache is memory the backward pass never reads (on an 8B model, every layer's keys and values)."""
    model = tiny("tiny-llama-random")
    caches = []
    model.register_forward_hook(lambda module, args, output: caches.append(output.past_key_values))
    compute_importance(model, describe_layout(model), calibration_ids(3, 8), micro_batch_size=2)
    assert caches == [None, None]


def test_scores_with_every_bias_equal_brute_force():
    """Llama with attention_bias and mlp_bias (no shipped model has MLP biases): q/k/v and gate/up biases belong to
    their groups; o_proj's and down_proj's to none."""
    model = llama(attention_bias=True, mlp_bias=True)
    layout = describe_layout(model)
    ids = calibration_ids(4, 16)
    ours = compute_importance(model, layout, ids % model.config.vocab_size, micro_batch_size=3)[4]
    attn, mlp, gmean, gnorm = brute_force(model, ids % model.config.vocab_size)
    assert_scores_close(ours.scores, attn, mlp)
    np.testing.assert_allclose(ours.grad_mean, gmean, rtol=1e-5)
    np.testing.assert_allclose(ours.grad_norm, gnorm, rtol=1e-5)
