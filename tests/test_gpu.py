"""The same engine on CUDA: skipped where there is no GPU (the project's CPU machines and CI)."""

import numpy as np
import pytest
import torch

from taylor_tune.config import PruneConfig
from taylor_tune.pruning.apply import apply_plan
from taylor_tune.pruning.groups import describe_layout
from taylor_tune.pruning.importance import compute_importance
from taylor_tune.pruning.methods import METHODS, PlanOptions
from taylor_tune.sources.models import load_model, load_tokenizer
from tests.helpers import calibration_ids

pytestmark = pytest.mark.gpu


def test_cuda_fp32_scores_equal_cpu_scores():
    ids = calibration_ids(8, 32)
    cpu = load_model("tiny-llama-random", device="cpu")
    gpu = load_model("tiny-llama-random", device="cuda")
    a = compute_importance(cpu, describe_layout(cpu), ids, micro_batch_size=4)[8].scores
    b = compute_importance(gpu, describe_layout(gpu), ids, micro_batch_size=4)[8].scores
    for x, y in zip(a.mlp + a.attn, b.mlp + b.attn):
        np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-9)


def test_bf16_pass_ranks_like_fp32_and_prunes_on_cuda():
    ids = calibration_ids(8, 32)
    fp32 = load_model("tiny-qwen2-random", device="cuda", dtype=torch.float32)
    bf16 = load_model("tiny-qwen2-random", device="cuda", dtype=torch.bfloat16)
    s32 = compute_importance(fp32, describe_layout(fp32), ids)[8].scores
    s16 = compute_importance(bf16, describe_layout(bf16), ids)[8].scores
    ranks = [np.corrcoef(np.argsort(np.argsort(x)), np.argsort(np.argsort(y)))[0, 1] for x, y in zip(s32.mlp, s16.mlp)]
    assert min(ranks) > 0.9  # bf16 weights, fp32 accumulation: the ranking survives
    layout = describe_layout(bf16)
    plan = METHODS["taylor"].plan(s16, layout, PlanOptions.of(PruneConfig(model="tiny-qwen2-random")))
    model = apply_plan(bf16, plan)
    out = model.generate(ids[:1, :8].cuda(), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 12)


def test_a_cuda_trial_reports_its_peak_gpu_memory(tmp_path):
    from taylor_tune.config import PruneConfig
    from taylor_tune.schema import stage_seconds
    from taylor_tune.sweep.experiment import Evaluation
    from taylor_tune.sweep.trial import TrialConfig, run_trial

    trial = TrialConfig(
        prune=PruneConfig(
            model="tiny-llama", method="taylor", seq_len=32, num_samples=8, calibration="world", device="cuda"
        ),
        evaluation=Evaluation(tasks="piqa", task_data="world", ppl=None, batch_size=16, fidelities=[10]),
    )
    reports = []
    metrics = run_trial(trial, tmp_path, report=reports.append)
    weights = sum(p.numel() * 4 for p in load_model("tiny-llama", device="cpu").parameters())
    assert reports[-1]["peak_gpu_memory_bytes"] >= 0.5 * weights  # at least the (pruned) fp32 weights were on the GPU
    assert metrics["peak_gpu_memory_bytes"] == reports[-1]["peak_gpu_memory_bytes"]
    assert {"load", "calibration", "importance", "prune", "zero_shot_10"} <= set(stage_seconds(reports[-1]))


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, None)])
def test_prefix_scorer_on_cuda_agrees_with_hflm(dtype, tolerance):
    """fp32 on CUDA: HFLM's numbers within 1e-4. bf16: both scorers round differently (other matmul shapes), so the
    log-likelihoods are compared to 2%."""
    from tests.evaluation.test_scorer import responses

    model = load_model("tiny-llama", device="cuda", dtype=dtype).eval()
    tokenizer = load_tokenizer("tiny-llama")
    theirs, their_scores = responses(model, tokenizer, "hflm", batch_size="auto", limit=20)
    ours, our_scores = responses(model, tokenizer, "prefix", batch_size="auto", limit=20)
    assert_agree(ours, our_scores, theirs, their_scores, exact=tolerance is not None)


def assert_agree(ours: dict, our_scores: dict, theirs: dict, their_scores: dict, exact: bool) -> None:
    """exact (fp32): every request within 1e-4 and the same accuracies; else (bf16) log-likelihoods within 2%."""
    from tests.evaluation.test_scorer import assert_same_answers

    if exact:
        assert_same_answers(ours, theirs)
        assert our_scores == their_scores
        return
    for task in theirs:
        for (ll, _), (ref, _) in zip(ours[task], theirs[task], strict=True):
            assert abs(ll - ref) <= 0.02 * max(1.0, abs(ref)), task


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_attention_scores_like_sdpa_on_cuda(dtype):
    """Issue 30, point 5 on the device it is for: the prefix scorer with FlexAttention's block mask gives SDPA's
    answers (fp32: within 1e-4, the same accuracies; bf16: the kernels round differently, log-likelihoods within 2%)."""
    from taylor_tune.evaluation.scorer import PrefixLM
    from tests.evaluation.test_scorer import responses

    model = load_model("tiny-llama", device="cuda", dtype=dtype).eval()
    tokenizer = load_tokenizer("tiny-llama")
    sdpa, sdpa_scores = responses(model, tokenizer, "prefix", batch_size="auto", limit=20)
    try:
        PrefixLM.attention = "flex"
        flex, flex_scores = responses(model, tokenizer, "prefix", batch_size="auto", limit=20)
    finally:
        PrefixLM.attention = "sdpa"
    assert_agree(flex, flex_scores, sdpa, sdpa_scores, exact=dtype == torch.float32)
