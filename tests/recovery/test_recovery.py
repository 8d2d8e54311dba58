"""Recovery fine-tuning on the tiny trained models: it lowers the held-out loss of a pruned model, the merged model
computes what the adapters did, a uniform model still loads in stock transformers, and the distillation loss is a
KL divergence computed independently."""

import pytest
import torch
from pydantic import ValidationError

from taylor_tune.config import PruneConfig, RecoverySpec
from taylor_tune.pruning.apply import save_pruned
from taylor_tune.pruning.prune import prune
from taylor_tune.recovery.losses import distillation_loss
from taylor_tune.recovery.train import attach_lora, heldout_loss, recover
from taylor_tune.sources.data import load_ppl_text
from taylor_tune.sources.models import load_model
from taylor_tune.sources.recovery_data import recovery_ids
from tests.helpers import tiny

SPEC = dict(data="world", steps=30, lr=2e-3, warmup_steps=3, micro_batch_size=8, seq_len=64, lora_rank=8,
            lora_dropout=0.0)


def pruned(uniform: bool = False):
    return prune(PruneConfig(model="tiny-llama", method="taylor", sparsity=0.4, seq_len=32, num_samples=16,
                             calibration="world", device="cpu", dtype="float32", uniform=uniform,
                             uniform_multiple=8))


def heldout(tokenizer, seq_len: int = 64, windows: int = 8) -> torch.Tensor:
    ids = tokenizer(load_ppl_text("world"), add_special_tokens=False)["input_ids"][: seq_len * windows]
    return torch.tensor(ids).view(windows, seq_len)


@pytest.mark.slow  # trains for seconds
def test_recovery_lowers_the_heldout_loss_of_the_same_pruned_model():
    result = pruned()
    spec = RecoverySpec(**SPEC, eval_every=10)
    held = heldout(result.tokenizer)
    unrecovered = heldout_loss(pruned().model, held, 8)  # the same pruning (deterministic), never recovered
    curve = []
    recovered = recover(result.model, recovery_ids(result.tokenizer, spec, "tiny-llama"), held, spec,
                        report=lambda step, loss, train: curve.append((step, train)))
    assert recovered.loss_before == pytest.approx(unrecovered)
    assert recovered.loss_after < recovered.loss_before - 0.05
    assert [s for s, _ in curve] == [10, 20] and [s for s, _ in recovered.curve] == [0, 10, 20, 30]
    # each point carries the mean training loss of the steps since the one before
    assert [t for _, t in curve] == pytest.approx([sum(recovered.train_loss[:10]) / 10,
                                                   sum(recovered.train_loss[10:20]) / 10])
    assert heldout_loss(recovered.model, held, 8) == pytest.approx(recovered.loss_after)
    assert len(recovered.train_loss) == 30 and all(torch.isfinite(torch.tensor(recovered.train_loss)))
    # the shapes pruning left stay as they were
    assert sum(p.numel() for p in recovered.model.parameters()) == result.diagnostics["params_count"]


def test_the_merged_model_computes_what_the_adapters_did(arch):
    """Issue 82, must-show 1, for every family: a LoRA recovery step runs on its target modules (the adapters move)
    and the merged model computes what the model with the adapters on did."""
    from taylor_tune.recovery.train import step_loss

    model = tiny(arch)
    spec = RecoverySpec(**SPEC)
    adapted = attach_lora(model, spec)
    trainable = [p for p in adapted.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    step_loss(adapted.train(), torch.randint(0, 256, (2, 16)), spec, None).backward()
    optimizer.step()
    assert all(float(p.detach().abs().max()) > 0 for name, p in adapted.named_parameters() if "lora_B" in name)
    torch.manual_seed(1)
    with torch.no_grad():  # B further from 0 than one step takes it, so that a merge that drops one shows
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    ids = torch.randint(0, 256, (2, 24))
    adapted.eval()
    with torch.no_grad():
        before = adapted(input_ids=ids).logits
        merged = adapted.merge_and_unload()
        after = merged(input_ids=ids).logits
    assert (before - after).abs().max() <= 1e-5
    assert not any("lora" in name for name, _ in merged.named_parameters())


@pytest.mark.slow  # trains for seconds
def test_a_recovered_uniform_model_reloads_in_stock_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    result = pruned(uniform=True)
    spec = RecoverySpec(**{**SPEC, "steps": 4})
    held = heldout(result.tokenizer, windows=2)
    recovered = recover(result.model, recovery_ids(result.tokenizer, spec, "tiny-llama"), held, spec)
    save_pruned(recovered.model, tmp_path / "model", tokenizer=result.tokenizer, source_model="tiny-llama")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")  # no remote code: a stock class
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=held).logits, recovered.model(input_ids=held).logits, atol=1e-5)


def kl_by_hand(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> float:
    """Per token, with plain sums: Σ_v p_t(v) (log p_t(v) - log p_s(v)), the mean over every predicting position."""
    values = []
    for b in range(student.shape[0]):
        for t in range(student.shape[1] - 1):
            p_t = torch.softmax(teacher[b, t].double() / temperature, -1)
            p_s = torch.softmax(student[b, t].double() / temperature, -1)
            values.append(float(sum(p_t[v] * (p_t[v].log() - p_s[v].log()) for v in range(p_t.shape[0]))))
    return sum(values) / len(values) * temperature**2


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_distillation_is_a_kl_divergence_and_zero_against_an_identical_teacher(temperature):
    torch.manual_seed(0)
    student = torch.randn(2, 5, 11, requires_grad=True)
    teacher = torch.randn(2, 5, 11)
    assert float(distillation_loss(student, teacher, temperature).detach()) == pytest.approx(
        kl_by_hand(student.detach(), teacher, temperature), rel=1e-5)
    same = distillation_loss(student, student.detach().clone(), temperature)
    same.backward()
    assert float(same.detach()) == pytest.approx(0.0, abs=1e-6) and student.grad.abs().max() <= 1e-7


def test_a_model_distilled_from_an_identical_copy_gets_zero_loss_and_zero_gradient():
    model, copy = tiny("tiny-llama-random"), tiny("tiny-llama-random")
    ids = torch.randint(0, 256, (2, 16))
    loss = distillation_loss(model(input_ids=ids).logits, copy(input_ids=ids).logits)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-6)
    assert max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None) <= 1e-6


@pytest.mark.slow  # trains for seconds
def test_kd_recovery_moves_the_pruned_model_toward_the_unpruned_one():
    result = pruned()
    spec = RecoverySpec(**{**SPEC, "loss": "kd", "steps": 20})
    teacher = load_model("tiny-llama", dtype=torch.float32)
    held = heldout(result.tokenizer)
    with torch.no_grad():
        target = teacher(input_ids=held).logits
        start = float(distillation_loss(result.model(input_ids=held).logits, target))
    recovered = recover(result.model, recovery_ids(result.tokenizer, spec, "tiny-llama"), held, spec, teacher=teacher)
    with torch.no_grad():
        end = float(distillation_loss(recovered.model(input_ids=held).logits, target))
    assert end < start * 0.9
    with pytest.raises(ValueError, match="needs the unpruned model"):
        recover(pruned().model, recovery_ids(result.tokenizer, spec, "tiny-llama"), held, spec)


@pytest.mark.parametrize("field, value, message", [
    ("loss", "mse", "loss"), ("lora_rank", 0, "lora_rank"), ("lora_dropout", 1.0, "lora_dropout"),
    ("target_modules", ["embed_tokens"], "target_modules"), ("lr", float("nan"), "lr"), ("kd_weight", 1.5, "kd_weight"),
])
def test_bad_recovery_settings_name_the_field(field, value, message):
    with pytest.raises(ValidationError, match=message):
        RecoverySpec(**{field: value})


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_recovery_keeps_float32_adapters_finite_losses_and_the_model_s_dtype(device):
    """bf16 student and teacher (the GPU's dtype; LLM-Pruner #13's NaN was fp16): the adapters train in float32
    (peft's autocast_adapter_dtype), every loss is finite, and the merged model is bf16 again, on its device."""
    result = prune(PruneConfig(model="tiny-llama", method="taylor", sparsity=0.4, seq_len=32, num_samples=16,
                               calibration="world", device=device, dtype="bfloat16"))
    assert next(result.model.parameters()).dtype == torch.bfloat16
    spec = RecoverySpec(**{**SPEC, "loss": "ce+kd", "steps": 6, "eval_every": 2})
    adapters = attach_lora(prune(PruneConfig(model="tiny-llama", method="taylor", sparsity=0.4, seq_len=32,
                                             num_samples=16, calibration="world", device=device,
                                             dtype="bfloat16")).model, spec)
    trained = {p.dtype for n, p in adapters.named_parameters() if p.requires_grad}
    assert trained == {torch.float32}
    teacher = load_model("tiny-llama", device=torch.device(device), dtype=torch.bfloat16)
    held = heldout(result.tokenizer).to(device)
    ids = recovery_ids(result.tokenizer, spec, "tiny-llama")
    recovered = recover(result.model, ids, held, spec, teacher=teacher)
    losses = [loss for _, loss in recovered.curve] + recovered.train_loss
    assert all(torch.isfinite(torch.tensor(losses)))
    assert {p.dtype for p in recovered.model.parameters()} == {torch.bfloat16}
    assert next(recovered.model.parameters()).device.type == device
    assert recovered.loss_after < recovered.loss_before


def test_the_heldout_loss_is_the_mean_token_loss_whatever_the_micro_batch_and_builds_no_graph():
    """Recovery's own held-out loss against a brute force over all windows at once (HF's own shifted loss, every
    predicted token weighing the same), on a model with LoRA adapters in training mode: eval mode inside (dropout
    off), no autograd graph kept, training mode given back."""
    from taylor_tune.sources.models import load_tokenizer

    model = tiny("tiny-llama")
    held = heldout(load_tokenizer("tiny-llama"), seq_len=32, windows=5)
    peft_model = attach_lora(model, RecoverySpec(**{**SPEC, "lora_dropout": 0.5}))
    peft_model.train()
    with torch.no_grad():
        peft_model.eval()
        expected = float(peft_model(input_ids=held, labels=held).loss)
        peft_model.train()
    seen = []
    hook = peft_model.register_forward_hook(lambda module, args, out: seen.append(out.logits.requires_grad))
    for micro_batch in (1, 2, 5):
        assert heldout_loss(peft_model, held, micro_batch) == pytest.approx(expected, rel=1e-5)
    hook.remove()
    assert seen and not any(seen) and peft_model.training
