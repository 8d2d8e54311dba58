"""The prefix-sharing scorer: lm-eval's HFLM's numbers, request by request, at fewer tokens.

References: lm-eval's own HFLM on the same model and requests, and a plain forward pass of HFLM's documented
model input (`(context + continuation)[-(max_length + 1):][:-1]`) computed here.
"""

import sys

import pytest
import torch
import torch.nn.functional as F
from lm_eval import simple_evaluate

from taylor_tune.config import build_eval_spec, build_prune_config
from taylor_tune.errors import ConfigError
from taylor_tune.evaluation.scorer import Pack, make_lm, plan_batches, plan_packs
from taylor_tune.evaluation.zero_shot import TASK_YAML, task_source
from taylor_tune.pruning.prune import prune
from taylor_tune.sources.models import load_model, load_tokenizer


def test_packs_group_requests_by_the_prefix_hflm_would_forward():
    requests = [([1, 2, 3], [4, 5]), ([1, 2, 3], [6]), ([1, 2, 3], [7, 8, 9]), ([1, 2], [3, 4])]
    packs = plan_packs(requests, max_length=100)
    assert [(p.prefix, p.members) for p in packs] == [
        ((1, 2, 3), [(0, [4, 5]), (1, [6]), (2, [7, 8, 9])]),  # 3 + 1 + 0 + 2 = 6 positions, longest first
        ((1, 2), [(3, [3, 4])]),
    ]
    assert [p.length for p in packs] == [6, 3]
    # max_length 4: HFLM forwards the last 5 tokens minus the last one, so continuations of one long context
    # that differ in length keep different prefixes
    long = [([1, 2, 3, 4, 5, 6], [7, 8]), ([1, 2, 3, 4, 5, 6], [9])]
    assert [(p.prefix, p.members) for p in plan_packs(long, max_length=4)] == [
        ((3, 4, 5, 6), [(1, [9])]), ((4, 5, 6), [(0, [7, 8])])]


def test_batches_fill_rows_first_fit_within_the_longest_pack():
    packs = [Pack(tuple(range(n)), [(i, [0])]) for i, n in enumerate([10, 9, 7, 3, 3, 2])]
    batches = plan_batches(packs, rows=2)
    assert [[[p.length for p in row] for row in batch] for batch in batches] == [[[10], [9]], [[7], [3, 3]], [[2]]]
    by_budget = plan_batches(packs, rows=None, budget=20)  # rows × width ≤ 20 tokens
    assert [[[p.length for p in row] for row in batch] for batch in by_budget] == [[[10], [9]], [[7], [3, 3]], [[2]]]


def _pruned_tiny_qwen2():
    return prune(
        build_prune_config(
            {
                "model": "tiny-qwen2",
                "method": "blockwise",
                "sparsity": 0.3,
                "calibration": "world",
                "seq_len": 32,
                "num_samples": 16,
                "device": "cpu",
                "blockwise_attention": "closest_ratio",
            }
        )
    )


def responses(
    model, tokenizer, scorer: str, batch_size: int, limit: int, task_data: str = "world"
) -> tuple[dict, dict]:
    """Every request's (log-likelihood, is_greedy) and each task's acc/acc_norm on the seven tasks."""
    lm = make_lm(model, tokenizer, batch_size, scorer)
    sources = [task_source(task, task_data) for task in TASK_YAML]
    result = simple_evaluate(model=lm, tasks=[s for s, _ in sources], task_manager=sources[0][1], limit=limit,
                             bootstrap_iters=0, log_samples=True, verbosity="ERROR")
    per_request = {
        task: [r[0] for sample in samples for r in sample["resps"]] for task, samples in result["samples"].items()
    }
    scores = {task: (raw.get("acc,none"), raw.get("acc_norm,none")) for task, raw in result["results"].items()}
    return per_request, scores


def assert_same_answers(ours: dict, theirs: dict) -> None:
    for task in theirs:
        assert len(ours[task]) == len(theirs[task]) > 0, task
        for (ll, greedy), (ref_ll, ref_greedy) in zip(ours[task], theirs[task]):
            assert abs(ll - ref_ll) <= 1e-4, (task, ll, ref_ll)
            assert greedy == ref_greedy, task


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral", "pruned tiny-qwen2"])
def test_prefix_scorer_equals_hflm_request_by_request(name):
    if name.startswith("pruned"):
        result = _pruned_tiny_qwen2()  # blockwise: layers of different widths and head counts
        model, tokenizer = result.model, result.tokenizer
        assert len({layer.mlp.gate_proj.out_features for layer in model.model.layers}) > 1
    else:
        model, tokenizer = load_model(name), load_tokenizer(name)
    model.eval()
    theirs, their_scores = responses(model, tokenizer, "hflm", batch_size=16, limit=12)
    ours, our_scores = responses(model, tokenizer, "prefix", batch_size=3, limit=12)  # small batches: rows and padding
    assert_same_answers(ours, theirs)
    assert our_scores == their_scores


def _short_window_model(max_length: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_length,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def reference(model, context: list[int], continuation: list[int], max_length: int) -> tuple[float, bool]:
    """HFLM's definition by a plain forward pass of its documented input."""
    model_input = (context + continuation)[-(max_length + 1):][:-1]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([model_input])).logits[0].float(), dim=-1)
    rows = logprobs[len(model_input) - len(continuation):]
    target = torch.tensor(continuation)
    return float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())


def test_a_context_longer_than_the_window_is_truncated_as_hflm_does():
    max_length = 16
    model, tokenizer = _short_window_model(max_length), load_tokenizer("tiny-llama")
    long_context = [(7 * i) % 60 + 1 for i in range(30)]
    requests = [(("q", c), long_context, c) for c in ([3], [4, 5], [6, 7, 8, 9, 10], list(range(20, 36)))]
    requests += [(("short", "a"), [5, 6, 7], [8, 9]), (("short", "b"), [5, 6, 7], [10])]
    assert any(len(ctx) + len(cont) > max_length + 1 for _, ctx, cont in requests)
    expected = [reference(model, ctx, cont, max_length) for _, ctx, cont in requests]
    for scorer in ("prefix", "hflm"):
        lm = make_lm(model, tokenizer, 4, scorer)
        assert lm.max_length == max_length
        got = lm._loglikelihood_tokens(requests, disable_tqdm=True)
        for (ll, greedy), (ref_ll, ref_greedy) in zip(got, expected, strict=True):
            assert abs(ll - ref_ll) <= 1e-4 and greedy == ref_greedy, scorer


def test_tokens_forwarded_equal_a_hand_count():
    model, tokenizer = load_model("tiny-llama"), load_tokenizer("tiny-llama")
    requests = [
        *[(None, [1, 2, 3, 4, 5], cont) for cont in ([6, 7, 8], [9, 10], [11, 12, 13, 14])],  # one context, 3 endings
        *[(None, [21, 22, 23, 24], cont) for cont in ([25], [26])],                          # yes/no: one token each
        (None, [31, 32, 33, 34, 35, 36], [37, 38]),
    ]
    # prefix: each context once, then every continuation but its last token
    by_hand_prefix = (5 + 2 + 1 + 3) + (4 + 0 + 0) + (6 + 1)
    # HFLM: context + continuation[:-1] per request; one-token continuations of one context share a forward
    by_hand_hflm = (5 + 2) + (5 + 1) + (5 + 3) + 4 + (6 + 1)
    prefix = make_lm(model, tokenizer, 1, "prefix")
    hflm = make_lm(model, tokenizer, 1, "hflm")
    prefix._loglikelihood_tokens(requests, disable_tqdm=True)
    hflm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert (prefix.tokens_forwarded, prefix.tokens_unpadded, hflm.tokens_forwarded) == (
        by_hand_prefix,
        by_hand_prefix,
        by_hand_hflm,
    )
    batched = make_lm(model, tokenizer, 16, "prefix")  # one forward: rows padded to the longest pack (11 positions)
    batched._loglikelihood_tokens(requests, disable_tqdm=True)
    assert batched.tokens_unpadded == by_hand_prefix
    assert batched.tokens_forwarded == 11 * 2  # rows [11] and [7, 4]


def test_scorer_is_validated():
    with pytest.raises(ConfigError, match="scorer: Input should be 'prefix' or 'hflm'"):
        build_eval_spec({"scorer": "fast"})
    assert build_eval_spec({}).scorer == "prefix"


def test_continuations_packed_after_one_prefix_see_the_prefix_and_themselves_only():
    """Three multi-token continuations of one context in one pack: each scored as if forwarded alone (a plain forward
    pass of context + continuation, and lm-eval's HFLM); seeing an earlier continuation of the pack would change it."""
    model, tokenizer = load_model("tiny-llama-random"), load_tokenizer("tiny-llama-random")
    context = [40, 41, 42, 43, 44, 45]
    endings = ([50, 51, 52, 53], [60, 61, 62], [70, 71, 72, 73, 74])
    requests = [(("q", i), context, ending) for i, ending in enumerate(endings)]
    assert len(plan_packs([(c, e) for _, c, e in requests], 512)) == 1  # one pack: the case under test
    expected = [reference(model, context, ending, 512) for ending in endings]
    for scorer in ("prefix", "hflm"):
        got = make_lm(model, tokenizer, 4, scorer)._loglikelihood_tokens(requests, disable_tqdm=True)
        for (ll, greedy), (ref_ll, ref_greedy) in zip(got, expected, strict=True):
            assert abs(ll - ref_ll) <= 1e-4 and greedy == ref_greedy, scorer


def test_a_bfloat16_model_is_scored_with_a_float32_log_softmax():
    """Issue 30, point 3: both scorers take the log-softmax of a bfloat16 model's logits in float32, as the reference
    (a plain forward pass, its logits cast to float32) does: equal to it; a bfloat16 log-softmax was 0.077 off over
    these three-token continuations."""
    model = load_model("tiny-llama-random", dtype=torch.bfloat16)
    tokenizer = load_tokenizer("tiny-llama-random")
    requests = [(("q", i), [40 + i, 41, 42, 43, 44], [50 + i, 51, 52]) for i in range(4)]
    expected = [reference(model, ctx, cont, 512) for _, ctx, cont in requests]
    for scorer in ("prefix", "hflm"):
        lm = make_lm(model, tokenizer, 1, scorer)
        assert lm.softmax_dtype == torch.float32
        got = lm._loglikelihood_tokens(requests, disable_tqdm=True)
        for (ll, greedy), (ref_ll, ref_greedy) in zip(got, expected, strict=True):
            assert abs(ll - ref_ll) <= 1e-5 and greedy == ref_greedy, (scorer, ll, ref_ll)


def _long_context_model():
    """A tiny random Llama whose config claims a 32k context, as Qwen2's does: lm-eval's probe would size at that."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768)
    return LlamaForCausalLM(config).eval()


def _requests(count: int = 24):
    return [(("q", i), [(5 * i + j) % 60 + 1 for j in range(3 + i % 9)], [(i + j) % 60 + 1 for j in range(1 + i % 4)])
            for i in range(count)]


def record_forward_shapes(monkeypatch, model) -> list[tuple[int, int]]:
    """Replaces model.forward (for the test) by one that records each pass's input_ids shape and runs the original;
    the list it returns fills as passes run. HFLM passes the ids by position, the prefix scorer by name."""
    shapes, forward = [], model.forward

    def recording(*args, **kwargs):
        shapes.append(tuple(kwargs.get("input_ids", args[0] if args else None).shape))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", recording)
    return shapes


def zero_logits_model(monkeypatch, model) -> list[tuple]:
    """Replaces model.forward (for the test) by a stand-in that records what each pass is given (ids, mask, the
    attention implementation it runs under) and returns logits of zero for the kept positions; no model runs."""
    seen = []

    def recording(input_ids=None, attention_mask=None, logits_to_keep=None, **kwargs):
        seen.append((input_ids, attention_mask, model.config._attn_implementation))
        return type("Output", (), {"logits": torch.zeros(int(logits_to_keep.sum()), model.config.vocab_size)})

    monkeypatch.setattr(model, "forward", recording)
    return seen


def test_auto_batches_are_sized_from_the_data_and_a_budget_never_by_a_probe(monkeypatch):
    """Issue 30, point 1: with batch_size auto, no forward pass is wider than the widest pack of the data or holds
    more tokens than the budget (injected here; on CUDA it comes from the free memory), lm-eval's probe at the
    config's 32k context is never called, and the answers are the fixed batch's."""
    model, tokenizer = _long_context_model(), load_tokenizer("tiny-llama")
    requests = _requests()
    expected = make_lm(model, tokenizer, 4, "prefix")._loglikelihood_tokens(requests, disable_tqdm=True)
    lm = make_lm(model, tokenizer, 4, "prefix")
    lm.batch_size_per_gpu, lm.token_budget = "auto", 60
    monkeypatch.setattr(lm, "_detect_batch_size", lambda *a, **k: pytest.fail("probed at the maximum context"))
    shapes = record_forward_shapes(monkeypatch, model)
    got = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    widest = max(pack.length for pack in plan_packs([(c, e) for _, c, e in requests], lm.max_length))
    assert len(shapes) > 1 and all(width <= widest and (rows * width <= 60 or rows == 1) for rows, width in shapes)
    for (ll, greedy), (ref_ll, ref_greedy) in zip(got, expected, strict=True):
        assert abs(ll - ref_ll) <= 1e-5 and greedy == ref_greedy


def test_out_of_memory_halves_the_budget_once_and_a_second_time_fails(monkeypatch):
    model, tokenizer = _long_context_model(), load_tokenizer("tiny-llama")
    requests = _requests()
    expected = make_lm(model, tokenizer, 4, "prefix")._loglikelihood_tokens(requests, disable_tqdm=True)
    lm = make_lm(model, tokenizer, 4, "prefix")
    lm.batch_size_per_gpu, lm.token_budget = "auto", 80
    shapes, forward = [], model.forward

    def tight(*args, input_ids=None, **kwargs):  # a device that holds 40 tokens per pass
        if input_ids.numel() > 40 and input_ids.shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        shapes.append(tuple(input_ids.shape))
        return forward(*args, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(model, "forward", tight)
    got = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert all(rows * width <= 40 or rows == 1 for rows, width in shapes)
    for (ll, greedy), (ref_ll, ref_greedy) in zip(got, expected, strict=True):
        assert abs(ll - ref_ll) <= 1e-5 and greedy == ref_greedy
    lm.token_budget = 200  # needs two halvings: the second failure is raised

    with pytest.raises(torch.OutOfMemoryError):
        lm._loglikelihood_tokens(requests, disable_tqdm=True)


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts every way a tensor's values reach Python (item, tolist, float/int/bool/index: on CUDA each one waits
    for the device and copies) while `counting` is set; the model's own forward switches it off."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__,
             torch.Tensor.__bool__, torch.Tensor.__index__}

    def __init__(self):
        super().__init__()
        self.reads, self.counting = [], True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.counting and func in self.READS:
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_scoring_copies_to_the_host_once_per_batch():
    """Issue 30, point 2: every continuation's log-likelihood and greedy check are computed on the device and come
    back in one copy per forward pass (the model's own forward not counted); the answers are HFLM's definition."""
    model, tokenizer = load_model("tiny-llama-random"), load_tokenizer("tiny-llama-random")
    requests = _requests(40)
    expected = [reference(model, ctx, cont, 512) for _, ctx, cont in requests]
    lm = make_lm(model, tokenizer, 4, "prefix")
    counter, forward, passes = HostReads(), model.forward, []

    def uncounted(*args, **kwargs):
        counter.counting = False
        try:
            passes.append(1)
            return forward(*args, **kwargs)
        finally:
            counter.counting = True

    model.forward = uncounted
    with counter:
        got = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    del model.forward
    assert len(passes) > 3 and counter.reads == ["tolist"] * len(passes), counter.reads
    for (ll, greedy), (ref_ll, ref_greedy) in zip(got, expected, strict=True):
        assert abs(ll - ref_ll) <= 1e-4 and greedy == ref_greedy


def test_the_flex_block_mask_is_the_additive_masks_pattern():
    """Issue 30, point 5: the FlexAttention block mask built from a batch's segments allows exactly the positions the
    additive mask leaves at 0 (rows of several packs and continuations, padding at the end of one)."""
    from torch.nn.attention.flex_attention import create_mask

    from taylor_tune.evaluation.scorer import additive_mask, block_mask

    lm = make_lm(load_model("tiny-llama-random"), load_tokenizer("tiny-llama-random"), 2, "prefix")
    packs = plan_packs([([1, 2, 3, 4], [5, 6]), ([1, 2, 3, 4], [7, 8, 9]), ([10, 11], [12]), ([10, 11], [13, 14]),
                        ([20, 21], [23, 24])], 512)
    batch = plan_batches(packs, 2)[0]
    _, _, segment, prefix_of, keep = lm._prepare(batch).inputs
    rows, width = segment.shape
    assert rows == 2 and sum(len(row) for row in batch) > rows and not bool(keep.all())  # packs share rows; padding
    additive = additive_mask(segment, prefix_of, torch.float32)[:, 0] == 0
    flex = create_mask(block_mask(segment, prefix_of).mask_mod, rows, None, width, width, device="cpu")[:, 0]
    assert torch.equal(flex, additive)
    assert 0 < int(additive.sum()) < rows * width * (width + 1) // 2  # block-causal: less than causal


@pytest.mark.slow
def test_flex_attention_scores_every_request_as_sdpa_does():
    """Issue 30, point 5: the prefix scorer with FlexAttention (the block mask from the pack layout, the model switched
    to transformers' flex_attention for the call) gives SDPA's answers on the seven tasks, request by request (fp32,
    1e-4), and leaves the model's attention as it was."""
    model, tokenizer = load_model("tiny-llama"), load_tokenizer("tiny-llama")
    model.eval()
    sdpa, sdpa_scores = responses(model, tokenizer, "prefix", batch_size=4, limit=6)
    from taylor_tune.evaluation.scorer import PrefixLM

    try:
        PrefixLM.attention = "flex"
        flex, flex_scores = responses(model, tokenizer, "prefix", batch_size=4, limit=6)
    finally:
        PrefixLM.attention = "sdpa"
    assert_same_answers(flex, sdpa)
    assert flex_scores == sdpa_scores
    assert model.config._attn_implementation == "sdpa"


def test_the_flex_block_mask_computes_each_rows_own_blocks_on_the_segments_device(monkeypatch):
    """The BlockMask's block map (which 128 x 128 blocks the kernel computes) row by row against the additive mask
    reduced to blocks by hand: a block is computed iff some query in it sees some key in it. Two rows whose maps
    differ (one 256-position pack; two packs of 128, so the second pack's queries see nothing of the first block).
    Made on the segments' device whatever accelerator the machine has (one faked here that is not the scores')."""
    from taylor_tune.evaluation.scorer import additive_mask, block_mask

    lm = make_lm(load_model("tiny-llama-random"), load_tokenizer("tiny-llama-random"), 2, "prefix")
    batch = [[Pack(tuple(range(1, 256)), [(0, [5, 6])])],
             [Pack(tuple(range(1, 128)), [(1, [7, 8])]), Pack(tuple(range(2, 129)), [(2, [9, 10])])]]
    assert [sum(p.length for p in row) for row in batch] == [256, 256]
    _, _, segment, prefix_of, _ = lm._prepare(batch).inputs
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("meta"))
    mask = block_mask(segment, prefix_of)
    allowed = additive_mask(segment, prefix_of, torch.float32)[:, 0] == 0  # [rows, 256, 256]
    by_block = allowed.reshape(2, 2, 128, 2, 128).any(dim=4).any(dim=2)  # [rows, query block, key block]
    assert by_block[0].tolist() == [[True, False], [True, True]] and by_block[1].tolist() == [[True, False],
                                                                                              [False, True]]
    dense = mask.to_dense()
    assert dense.device == segment.device and dense.shape == (2, 1, 2, 2)
    assert torch.equal(dense[:, 0].bool(), by_block)


def test_the_pass_tokens_are_scored_and_library_bars_follow_tqdm_disable(monkeypatch, capfd):
    """A request whose tokens the pass has (`encoded`: lm-eval's tokenization done once per pass, or read from the
    cache) is scored from those tokens, never tokenized again: tokens chosen here, unlike the tokenizer's, give a
    plain forward pass's answers of these tokens. lm-eval's "Tokenizing inputs" and HFLM's "Running loglikelihood
    requests" bars are drawn with an explicit disable=False (tqdm's own TQDM_DISABLE then does nothing): the scorer
    passes the variable on, with the pass's tokens or without; the bars are hidden as well when the caller asks."""
    from lm_eval.api.instance import Instance

    model, tokenizer = load_model("tiny-llama-random"), load_tokenizer("tiny-llama-random")
    requests = [Instance("loglikelihood", {}, (f"The answer {i} is", f" word {i}"), i) for i in range(3)]
    chosen = {r.args: ([40 + i, 41, 42, 43], [50 + i, 51]) for i, r in enumerate(requests)}

    def run(lm, disable_tqdm=None) -> tuple[str, list]:
        capfd.readouterr()
        got = lm.loglikelihood(requests) if disable_tqdm is None else lm.loglikelihood(requests, disable_tqdm)
        return capfd.readouterr().err, got

    for scorer, tokens in (("hflm", None), ("hflm", chosen), ("prefix", chosen)):
        lm = make_lm(model, tokenizer, 4, scorer)
        lm.encoded = tokens
        monkeypatch.delenv("TQDM_DISABLE", raising=False)
        shown, answers = run(lm)
        if tokens is not None:
            assert answers == [pytest.approx(reference(model, *tokens[r.args], 512), abs=1e-4) for r in requests]
        if scorer == "hflm":  # the prefix scorer draws a bar of its own (taylor_tune.progress)
            assert "Running loglikelihood requests" in shown
            assert ("Tokenizing inputs" in shown) == (tokens is None)
        hidden_by_caller, by_caller = run(lm, True)
        monkeypatch.setenv("TQDM_DISABLE", "1")
        hidden_by_variable, by_variable = run(lm)
        for hidden in (hidden_by_caller, hidden_by_variable):
            assert "Tokenizing" not in hidden and "loglikelihood requests" not in hidden
        assert by_caller == by_variable == answers


def test_auto_on_a_cpu_is_a_fixed_batch_of_16_as_documented(monkeypatch):
    """docs/evaluation.md: batch size `auto` is 16 on a CPU (lm-eval's search probes GPU memory). Both scorers
    forward what a batch of 16 forwards: the prefix scorer the planner's batches of 16 rows, HFLM 16 requests a pass,
    and lm-eval's probe is never called."""
    model, tokenizer = load_model("tiny-llama-random"), load_tokenizer("tiny-llama-random")
    requests = [(("q", i), [i + 1, *range(2, 2 + i % 7)], [(i + j) % 60 + 1 for j in range(1 + i % 4)])
                for i in range(40)]  # every context its own (first token), so HFLM shares no forward
    planned = plan_batches(plan_packs([(c, e) for _, c, e in requests], 512), 16)
    expected = {"prefix": [(len(batch), sum(pack.length for pack in batch[0])) for batch in planned],
                "hflm": [16, 16, 8]}
    assert max(rows for rows, _ in expected["prefix"]) == 16
    shapes = record_forward_shapes(monkeypatch, model)
    for scorer in ("prefix", "hflm"):
        lm = make_lm(model, tokenizer, "auto", scorer)
        monkeypatch.setattr(lm, "_detect_batch_size", lambda *a, **k: pytest.fail("probed"))
        shapes.clear()
        lm._loglikelihood_tokens(requests, disable_tqdm=True)
        assert (shapes if scorer == "prefix" else [rows for rows, _ in shapes]) == expected[scorer], scorer


def test_flex_attention_gives_the_model_the_block_mask_of_its_batch(monkeypatch):
    """With `attention` "flex" the model is called under transformers' flex_attention and given the FlexAttention
    block mask of its batch (block by block the mask `block_mask` builds from the batch's segments), never the
    additive one; afterwards its attention is what it was. (The answers under FlexAttention against SDPA's: the slow
    test below and tests/test_gpu.py; FlexAttention on a CPU compiles for a minute.) The model here is the zero-logits
    stand-in, recording what it was given."""
    from torch.nn.attention.flex_attention import BlockMask

    from taylor_tune.evaluation.scorer import block_mask

    model, tokenizer = load_model("tiny-llama-random"), load_tokenizer("tiny-llama-random")
    requests = _requests(6)
    lm = make_lm(model, tokenizer, 4, "prefix")
    lm.attention = "flex"
    seen = zero_logits_model(monkeypatch, model)
    lm._loglikelihood_tokens(requests, disable_tqdm=True)
    batches = plan_batches(plan_packs([(c, e) for _, c, e in requests], lm.max_length), 4)
    assert len(seen) == len(batches) > 1 and model.config._attn_implementation == "sdpa"
    for batch, (ids, mask, implementation) in zip(batches, seen, strict=True):
        inputs = lm._prepare(batch).inputs
        assert torch.equal(ids, inputs[0]) and implementation == "flex_attention" and isinstance(mask, BlockMask)
        assert torch.equal(mask.to_dense(), block_mask(inputs[2], inputs[3]).to_dense())


def test_make_lm_refuses_an_lm_eval_whose_hflm_lacks_what_the_prefix_scorer_reads(monkeypatch):
    """The scorer reads HFLM's attributes (compat.lm_eval.HFLM_ATTRIBUTES): an lm-eval whose HFLM instance lacks one
    (faked by one more name on the list) is refused when the scorer is made, naming it, not mid-pass."""
    from taylor_tune.compat import CompatError
    from taylor_tune.compat import lm_eval as compat

    monkeypatch.setattr(compat, "HFLM_ATTRIBUTES", (*compat.HFLM_ATTRIBUTES, "gone_in_this_version"))
    model, tokenizer = load_model("tiny-llama-random"), load_tokenizer("tiny-llama-random")
    for scorer in ("prefix", "hflm"):
        with pytest.raises(CompatError, match=r"HFLM\(\)\.gone_in_this_version"):
            make_lm(model, tokenizer, 4, scorer)


def test_both_scorers_refuse_the_requests_hflm_refuses_and_answer_none_with_nothing():
    """HFLM's preconditions on a request's tokens (a context; a continuation within the window) hold for the prefix
    scorer too: each malformed request is refused by both. The prefix scorer refuses an empty continuation as well
    (nothing to score: HFLM's own check of it sits in a branch this request does not reach). No requests, no answers."""
    model, tokenizer = _short_window_model(8), load_tokenizer("tiny-llama")
    fine = (("q", "fine"), [5, 6], [7])
    refused = {"hflm": [(("q", "no context"), [], [5, 6]), (("q", "too long"), [5, 6], list(range(1, 10)))]}
    refused["prefix"] = [*refused["hflm"], (("q", "no continuation"), [5, 6], [])]
    for scorer, malformed in refused.items():
        lm = make_lm(model, tokenizer, 4, scorer)
        for request in malformed:
            with pytest.raises(AssertionError):
                lm._loglikelihood_tokens([request, fine], disable_tqdm=True)
        assert lm._loglikelihood_tokens([], disable_tqdm=True) == []
        assert lm._loglikelihood_tokens([fine], disable_tqdm=True) == [pytest.approx(reference(model, [5, 6], [7], 8),
                                                                                     abs=1e-4)]


class RecordingHook:
    """lm-eval's cache hook (what its request cache, `use_cache`, stores each answer through), recording."""

    def __init__(self):
        self.added = []

    def add_partial(self, attr, req, res):
        self.added.append((attr, req, res))


def test_answers_reach_lm_evals_cache_hook_as_hflm_gives_them():
    """Every answer goes to lm-eval's cache hook under its request's key, as HFLM's own `_loglikelihood_tokens` gives
    it (a rolling window's pieces, whose key is None, are cached per document by the caller: not here)."""
    model, tokenizer = load_model("tiny-llama-random"), load_tokenizer("tiny-llama-random")
    requests = _requests(12) + [(None, [7, 8, 9, 10], [11, 12]), (None, [7, 8, 9, 10], [13])]
    added = {}
    for scorer in ("prefix", "hflm"):
        lm = make_lm(model, tokenizer, 4, scorer)
        lm.set_cache_hook(hook := RecordingHook())
        lm._loglikelihood_tokens(requests, disable_tqdm=True)
        added[scorer] = sorted(hook.added, key=lambda entry: entry[1])
    assert len(added["hflm"]) == 12 and [(a, k) for a, k, _ in added["prefix"]] == [(a, k) for a, k, _ in
                                                                                     added["hflm"]]
    for (*_, (ll, greedy)), (*_, (ref_ll, ref_greedy)) in zip(added["prefix"], added["hflm"], strict=True):
        assert abs(ll - ref_ll) <= 1e-4 and greedy == ref_greedy


def test_the_prefix_scorers_own_bar_counts_requests(monkeypatch, capfd):
    """The prefix scorer's bar (taylor_tune.progress, forced on here as on a terminal) is named zero-shot, counts
    requests (their number its total) and updates by a batch's requests (a bad count fails in tqdm)."""
    monkeypatch.setenv("TAYLOR_TUNE_PROGRESS", "1")
    lm = make_lm(load_model("tiny-llama-random"), load_tokenizer("tiny-llama-random"), 4, "prefix")
    capfd.readouterr()
    lm._loglikelihood_tokens(_requests(7), disable_tqdm=True)
    drawn = capfd.readouterr().err
    assert "zero-shot:" in drawn and "0/7" in drawn and "req/s" in drawn


def test_the_log_softmax_is_taken_in_chunks_within_the_bound(monkeypatch):
    """SOFTMAX_ELEMENTS bounds each float32 log-softmax over the vocabulary: every chunk holds at most that many
    elements (whole rows; one row when the bound is one row), together every kept position once; the answers are a
    plain forward pass's."""
    from taylor_tune.evaluation import scorer

    model, tokenizer = load_model("tiny-llama-random"), load_tokenizer("tiny-llama-random")
    requests = _requests(10)
    expected = [reference(model, ctx, cont, 512) for _, ctx, cont in requests]
    vocab, log_softmax = model.config.vocab_size, F.log_softmax
    for rows in (1, 3):
        chunks = []

        def recording(x, *args, **kwargs):
            chunks.append(tuple(x.shape))
            return log_softmax(x, *args, **kwargs)

        monkeypatch.setattr(scorer, "SOFTMAX_ELEMENTS", rows * vocab)
        monkeypatch.setattr(scorer.F, "log_softmax", recording)
        lm = make_lm(model, tokenizer, 16, "prefix")
        got = lm._loglikelihood_tokens(requests, disable_tqdm=True)
        monkeypatch.setattr(scorer.F, "log_softmax", log_softmax)
        kept = sum(pack.length - len(pack.prefix) + 1 for pack in plan_packs([(c, e) for _, c, e in requests], 512))
        assert all(n <= rows and width == vocab for n, width in chunks) and sum(n for n, _ in chunks) == kept
        for (ll, greedy), (ref_ll, ref_greedy) in zip(got, expected, strict=True):
            assert abs(ll - ref_ll) <= 1e-4 and greedy == ref_greedy


def test_a_fixed_batch_is_rows_only_and_auto_without_a_budget_is_16_rows_of_the_widest_pack(monkeypatch):
    """A fixed batch of 32 forwards the planner's batches of 32 rows, whatever their tokens (no token budget); `auto`
    on a CPU with no budget given holds 16 rows of the widest pack in tokens (the planner's batches at that budget)."""
    model, tokenizer = load_model("tiny-llama-random"), load_tokenizer("tiny-llama-random")
    requests = _requests(60)
    packs = plan_packs([(c, e) for _, c, e in requests], 512)
    shapes = record_forward_shapes(monkeypatch, model)
    for batch_size, planned in ((32, plan_batches(packs, 32)),
                                ("auto", plan_batches(packs, None, budget=16 * packs[0].length))):
        lm = make_lm(model, tokenizer, 32, "prefix")
        lm.batch_size_per_gpu = batch_size
        shapes.clear()
        lm._loglikelihood_tokens(requests, disable_tqdm=True)
        assert shapes == [(len(batch), sum(pack.length for pack in batch[0])) for batch in planned], batch_size
    assert plan_batches(packs, 32) != plan_batches(packs, None, budget=16 * packs[0].length)  # the two cases differ


def test_sdpa_gives_the_model_the_additive_mask_under_its_own_attention(monkeypatch):
    """With `attention` "sdpa" (the default) the model runs under its own attention implementation, never switched
    to flex_attention, and is given the additive mask of its batch's segments in its own dtype."""
    from taylor_tune.evaluation.scorer import additive_mask

    model, tokenizer = load_model("tiny-llama-random"), load_tokenizer("tiny-llama-random")
    requests = _requests(6)
    lm = make_lm(model, tokenizer, 4, "prefix")
    assert lm.attention == "sdpa"
    seen = zero_logits_model(monkeypatch, model)
    lm._loglikelihood_tokens(requests, disable_tqdm=True)
    batches = plan_batches(plan_packs([(c, e) for _, c, e in requests], lm.max_length), 4)
    assert len(seen) == len(batches) > 1
    for batch, (ids, mask, implementation) in zip(batches, seen, strict=True):
        inputs = lm._prepare(batch).inputs
        assert implementation == "sdpa" and torch.equal(ids, inputs[0])
        assert torch.equal(mask, additive_mask(inputs[2], inputs[3], model.dtype))


def test_answers_are_float64_sums_of_the_tokens_float32_log_probabilities(monkeypatch):
    """A continuation's log-likelihood is the float64 sum of its tokens' float32 log-probabilities, in float64 up to
    the answer (no float32 on the way back): with a model whose logits are all zero each token's is float32(-log V),
    so n tokens sum to exactly n times that; the greedy check is argmax's first index, token 0 (lm-eval's tie rule)."""
    model, tokenizer = load_model("tiny-llama-random"), load_tokenizer("tiny-llama-random")
    per_token = float(F.log_softmax(torch.zeros(model.config.vocab_size), dim=-1)[0])  # float32's value
    requests = [(("q", n), [5 + n, 6], [(7 * n + j) % 50 + 1 for j in range(n)]) for n in range(1, 12)]
    requests += [(("zero", 1), [3], [0, 0]), (("zero", 2), [4], [0, 9])]
    assert any(float(torch.tensor(n * per_token, dtype=torch.float32)) != n * per_token for n in range(1, 12))
    zero_logits_model(monkeypatch, model)
    got = make_lm(model, tokenizer, 4, "prefix")._loglikelihood_tokens(requests, disable_tqdm=True)
    assert got == [(len(cont) * per_token, all(token == 0 for token in cont)) for _, _, cont in requests]


def allowed_by_hand(batch: list[list[Pack]], width: int) -> torch.Tensor:
    """[rows, width, width], who sees whom, position by position from the packs' layout (a pack: its prefix, then each
    continuation but its last token): a prefix position sees its pack's prefix up to itself, a continuation position
    that prefix and its own continuation up to itself, padding only itself."""
    allowed = torch.zeros(len(batch), width, width, dtype=torch.bool)
    for r, packs in enumerate(batch):
        owner = []  # (pack, continuation or None for the prefix) of each real position of the row
        for k, pack in enumerate(packs):
            owner += [(k, None)] * len(pack.prefix)
            for index, cont in pack.members:
                owner += [(k, index)] * (len(cont) - 1)
        for i in range(width):
            for j in range(i + 1):
                if i == j:
                    allowed[r, i, j] = True
                elif i < len(owner):
                    (pack_i, member_i), (pack_j, member_j) = owner[i], owner[j]
                    allowed[r, i, j] = pack_i == pack_j and member_j in (None, member_i)
    return allowed


def test_a_prepared_batchs_mask_is_who_sees_whom_by_hand():
    """The additive mask of a prepared batch allows exactly what the packs say, written by hand position by position
    (allowed_by_hand): padding sees only itself, never a real position, also when every real position is a segment
    of its own (so that the padding's own numbers come right after the real ones)."""
    from taylor_tune.evaluation.scorer import additive_mask

    lm = make_lm(load_model("tiny-llama-random"), load_tokenizer("tiny-llama-random"), 2, "prefix")
    cases = ([([1], [2, 3]), ([1], [4, 5]), ([6], [7, 8])],  # segments of one position each; padding after the last
             [([1, 2, 3, 4], [5, 6]), ([1, 2, 3, 4], [7, 8, 9]), ([10, 11], [12]), ([10, 11], [13, 14]),
              ([20, 21], [23, 24]), ([30], [31, 32, 33, 34, 35, 36])])
    padded = 0
    for requests in cases:
        for batch in plan_batches(plan_packs(requests, 512), 2):
            _, _, segment, prefix_of, _ = lm._prepare(batch).inputs
            padded += int((segment < 0).sum())
            got = additive_mask(segment, prefix_of, torch.float32)[:, 0] == 0
            assert torch.equal(got, allowed_by_hand(batch, segment.shape[1]))
    assert padded > 1


def test_the_additive_mask_is_made_on_the_segments_device():
    """additive_mask builds on the segments' device whatever it is (the meta device stands in for an accelerator:
    a mask or a column index made on the CPU beside it fails or lands on the CPU), in the dtype asked for."""
    from taylor_tune.evaluation.scorer import additive_mask

    segment = torch.tensor([[0, 0, 1, -4], [2, 3, -7, -8]])
    prefix_of = torch.tensor([[0, 0, 0, -4], [2, 2, -7, -8]])
    on_cpu = additive_mask(segment, prefix_of, torch.float16)
    on_meta = additive_mask(segment.to("meta"), prefix_of.to("meta"), torch.float16)
    assert on_meta.device.type == "meta" and on_meta.shape == on_cpu.shape == (2, 1, 4, 4)
    assert on_meta.dtype == on_cpu.dtype == torch.float16


def test_out_of_memory_plans_the_passes_left_at_half_the_budget(monkeypatch):
    """After an out-of-memory pass the passes not yet done (the failed one's on) are the planner's at half the budget,
    and the halving stops at one token: one-token packs that fail two to a pass at a budget of 2 then go one by one."""
    model, tokenizer = _long_context_model(), load_tokenizer("tiny-llama")
    forward = model.forward
    for requests, budget, holds in ((_requests(), 80, 40), ([(("q", i), [i + 1], [i + 20]) for i in range(5)], 2, 1)):
        expected = make_lm(model, tokenizer, 4, "prefix")._loglikelihood_tokens(requests, disable_tqdm=True)
        packs = plan_packs([(c, e) for _, c, e in requests], 512)
        planned = plan_batches(packs, None, budget=budget)
        failed = next(d for d, batch in enumerate(planned)
                      if len(batch) > 1 and len(batch) * sum(p.length for p in batch[0]) > holds)
        done = [id(pack) for batch in planned[:failed] for row in batch for pack in row]
        passes = planned[:failed] + plan_batches([p for p in packs if id(p) not in done], None, budget=budget // 2)
        lm = make_lm(model, tokenizer, 4, "prefix")
        lm.batch_size_per_gpu, lm.token_budget = "auto", budget
        shapes = []

        def tight(*args, input_ids=None, _holds=holds, _shapes=shapes, **kwargs):  # a device that holds `holds`
            if input_ids.numel() > _holds and input_ids.shape[0] > 1:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            _shapes.append(tuple(input_ids.shape))
            return forward(*args, input_ids=input_ids, **kwargs)

        monkeypatch.setattr(model, "forward", tight)
        got = lm._loglikelihood_tokens(requests, disable_tqdm=True)
        monkeypatch.setattr(model, "forward", forward)
        assert shapes == [(len(batch), sum(p.length for p in batch[0])) for batch in passes], budget
        for (ll, greedy), (ref_ll, ref_greedy) in zip(got, expected, strict=True):
            assert abs(ll - ref_ll) <= 1e-5 and greedy == ref_greedy


@pytest.mark.slow
def test_fused_scoring_gives_the_eager_answers_on_layers_of_different_widths_with_one_graph(monkeypatch):
    """The prefix scorer with its decoder layers compiled (fused) against the same scorer eager, fp32 on CPU,
    every request within 1e-4 and the same accuracies, on a pruned model whose layers differ in width and head
    count; the layers share one compiled graph (at most one more where a layer keeps a single key-value head, a
    size Dynamo specializes) instead of one per shape, and are eager again after the pass."""
    result = _pruned_tiny_qwen2()
    model, tokenizer = result.model.eval(), result.tokenizer
    layers = model.model.layers
    shapes = {(layer.self_attn.q_proj.out_features, layer.self_attn.k_proj.out_features,
               layer.mlp.gate_proj.out_features) for layer in layers}
    assert len(shapes) >= 3
    eager, eager_scores = responses(model, tokenizer, "prefix", batch_size=3, limit=12)
    lms, eager_lm = [], make_lm

    def fused_lm(*args, **kwargs):
        lms.append(eager_lm(*args, **kwargs, fused=True))
        return lms[-1]

    torch._dynamo.reset()
    monkeypatch.setattr(sys.modules[__name__], "make_lm", fused_lm)
    fused, fused_scores = responses(model, tokenizer, "prefix", batch_size=3, limit=12)
    assert_same_answers(fused, eager)
    assert fused_scores == eager_scores
    kv_heads = {layer.self_attn.k_proj.out_features // layer.self_attn.head_dim for layer in layers}
    assert lms[0].fused and 1 <= lms[0].compiled_graphs <= 1 + (1 in kv_heads and len(kv_heads) > 1)
    assert not any("forward" in vars(layer) for layer in layers)  # given back


def test_fused_is_off_by_default_and_refused_for_hflm():
    assert build_eval_spec({}).fused is False
    assert build_eval_spec({"fused": "true"}).fused is True  # as the CLI's --fused true gives it
    with pytest.raises(ConfigError, match="fused"):
        build_eval_spec({"scorer": "hflm", "fused": True})
