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
    from taylor_tune.config import Evaluation, PruneConfig
    from taylor_tune.schema import stage_seconds
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


# bf16 keeps 8 significant bits: a value x is held to within |x| * 2**-8 (the unit roundoff). No tighter statement
# holds for two bf16 computations of one log-likelihood that round in different places (other batch shapes, other
# kernels), so a bf16 scorer is held to the fp32 truth: no further from it than lm-eval's own bf16 pass is, plus one
# unit roundoff of the value.
BF16_UNIT_ROUNDOFF = 2.0**-8


def loglikelihoods(answers: dict) -> dict:
    return {task: np.array([ll for ll, _ in rows]) for task, rows in answers.items()}


def assert_as_accurate(ours: dict, theirs: dict, truth: dict) -> None:
    """Per task: mean |ours - truth| <= mean |theirs - truth| + BF16_UNIT_ROUNDOFF * mean |truth| (log-likelihoods)."""
    ours, theirs, truth = loglikelihoods(ours), loglikelihoods(theirs), loglikelihoods(truth)
    for task, exact in truth.items():
        assert len(ours[task]) == len(theirs[task]) == len(exact) > 0, task
        ours_err, theirs_err = np.abs(ours[task] - exact).mean(), np.abs(theirs[task] - exact).mean()
        slack = BF16_UNIT_ROUNDOFF * np.abs(exact).mean()
        print(f"{task}: mean |error| ours {ours_err:.4g}, theirs {theirs_err:.4g}, one roundoff {slack:.4g}")
        assert ours_err <= theirs_err + slack, (task, ours_err, theirs_err, slack)


def test_prefix_scorer_on_cuda_fp32_equals_hflm():
    """fp32 on CUDA: HFLM's log-likelihoods within 1e-4 request by request and the same accuracies."""
    from tests.evaluation.test_scorer import assert_same_answers, responses

    model = load_model("tiny-llama", device="cuda", dtype=torch.float32).eval()
    tokenizer = load_tokenizer("tiny-llama")
    theirs, their_scores = responses(model, tokenizer, "hflm", batch_size="auto", limit=20)
    ours, our_scores = responses(model, tokenizer, "prefix", batch_size="auto", limit=20)
    assert_same_answers(ours, theirs)
    assert our_scores == their_scores


def test_prefix_scorer_on_cuda_bf16_is_as_accurate_as_hflm():
    """bf16: the prefix scorer's log-likelihoods are as near the fp32 truth (HFLM in fp32) as HFLM's in bf16 are,
    within one bf16 unit roundoff of the value (BF16_UNIT_ROUNDOFF)."""
    from tests.evaluation.test_scorer import responses

    tokenizer = load_tokenizer("tiny-llama")
    truth, _ = responses(load_model("tiny-llama", device="cuda", dtype=torch.float32).eval(), tokenizer, "hflm",
                         batch_size="auto", limit=20)
    model = load_model("tiny-llama", device="cuda", dtype=torch.bfloat16).eval()
    theirs, _ = responses(model, tokenizer, "hflm", batch_size="auto", limit=20)
    ours, _ = responses(model, tokenizer, "prefix", batch_size="auto", limit=20)
    assert_as_accurate(ours, theirs, truth)


def flex_model(dtype: torch.dtype):
    """tiny-llama's shape with a head dimension of 16, random weights (seed 0): FlexAttention's compiled kernel
    refuses heads narrower than 16 (the trained tiny models' are 8)."""
    from transformers import AutoModelForCausalLM

    from taylor_tune.sources.models import tiny_config

    config = tiny_config("tiny-llama-random")
    config.head_dim, config.num_attention_heads, config.num_key_value_heads = 16, 4, 2
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to("cuda").eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_attention_scores_like_sdpa_on_cuda(dtype):
    """Issue 30, point 5 on the device it is for: the prefix scorer with FlexAttention's block mask gives SDPA's
    answers (fp32: within 1e-4, the same accuracies; bf16: as near the fp32 truth as SDPA's bf16 pass, within one
    unit roundoff)."""
    from taylor_tune.evaluation.scorer import PrefixLM
    from tests.evaluation.test_scorer import assert_same_answers, responses

    tokenizer = load_tokenizer("tiny-llama-random")
    model = flex_model(dtype)
    sdpa, sdpa_scores = responses(model, tokenizer, "prefix", batch_size="auto", limit=20)
    try:
        PrefixLM.attention = "flex"
        flex, flex_scores = responses(model, tokenizer, "prefix", batch_size="auto", limit=20)
    finally:
        PrefixLM.attention = "sdpa"
    if dtype == torch.float32:
        assert_same_answers(flex, sdpa)
        assert flex_scores == sdpa_scores
        return
    truth, _ = responses(flex_model(torch.float32), tokenizer, "prefix", batch_size="auto", limit=20)
    assert_as_accurate(flex, sdpa, truth)


@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.xfail(
        strict=False, reason="failed its bound once in two runs on an H200 (2026-11-28, BENCHMARKS): why the fused "
        "bf16 pass can land further from the fp32 truth than HFLM's bf16 pass is not yet known; fused stays off by "
        "default")),
])
def test_fused_prefix_scorer_on_cuda_scores_like_hflm(dtype, monkeypatch):
    """The prefix scorer with its decoder layers compiled (fused) on the device it is for: fp32, HFLM's
    log-likelihoods within 1e-4 and the same accuracies; bf16, as near the fp32 truth as HFLM's bf16 pass, within one
    unit roundoff (BF16_UNIT_ROUNDOFF)."""
    import tests.evaluation.test_scorer as scoring
    from taylor_tune.evaluation.scorer import make_lm

    tokenizer = load_tokenizer("tiny-llama")
    model = load_model("tiny-llama", device="cuda", dtype=dtype).eval()
    theirs, their_scores = scoring.responses(model, tokenizer, "hflm", batch_size="auto", limit=20)
    lms = []
    monkeypatch.setattr(scoring, "make_lm", lambda *a, **k: lms.append(make_lm(*a, **k, fused=True)) or lms[-1])
    ours, our_scores = scoring.responses(model, tokenizer, "prefix", batch_size="auto", limit=20)
    assert lms[0].fused and lms[0].compiled_graphs >= 1
    if dtype == torch.float32:
        scoring.assert_same_answers(ours, theirs)
        assert our_scores == their_scores
        return
    truth, _ = scoring.responses(load_model("tiny-llama", device="cuda", dtype=torch.float32).eval(), tokenizer,
                                 "hflm", batch_size="auto", limit=20)
    assert_as_accurate(ours, theirs, truth)
