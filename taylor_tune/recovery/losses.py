"""The recovery losses, pure torch: next-token cross-entropy and distillation (KL divergence to a teacher's
next-token distribution at a temperature). Every predicted token weighs the same."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of position t's logits against token t+1, in float32."""
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(teacher || student) of the softened next-token distributions, per token, averaged over tokens and scaled
    by temperature² (so the gradient's size does not shrink with the temperature, as Hinton et al.). Both logits
    [batch, seq, vocab]; the teacher's carry no gradient. Computed in float32."""
    s = F.log_softmax(student[:, :-1].float() / temperature, dim=-1)
    t = F.log_softmax(teacher[:, :-1].detach().float() / temperature, dim=-1)
    per_token = (t.exp() * (t - s)).sum(-1)
    return per_token.mean() * temperature**2
