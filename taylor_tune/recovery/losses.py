"""The recovery losses, pure torch: next-token cross-entropy and distillation (KL divergence to a teacher's
next-token distribution at a temperature). Every predicted token weighs the same; with a `mask` ([batch, seq], 1
where a token is a target: an instruction's response), only the masked tokens are predicted."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _mean(per_token: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean over predicted tokens: position t predicts token t+1, counted where mask[:, t+1] is 1 (a batch
    without any gives 0, not NaN)."""
    if mask is None:
        return per_token.mean()
    weight = mask[:, 1:].to(per_token.dtype)
    return (per_token * weight).sum() / weight.sum().clamp(min=1)


def token_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq - 1]: the cross-entropy of position t's logits against token t+1, in float32."""
    per_token = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    return per_token.view(ids.shape[0], -1)


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of position t's logits against token t+1, in float32."""
    return _mean(token_losses(logits, ids), mask)


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """KL(teacher || student) of the softened next-token distributions, per token, averaged over tokens and scaled
    by temperature² (so the gradient's size does not shrink with the temperature, as Hinton et al.). Both logits
    [batch, seq, vocab]; the teacher's carry no gradient. Computed in float32."""
    s = F.log_softmax(student[:, :-1].float() / temperature, dim=-1)
    t = F.log_softmax(teacher[:, :-1].detach().float() / temperature, dim=-1)
    per_token = (t.exp() * (t - s)).sum(-1)
    return _mean(per_token, mask) * temperature**2
