"""Helpers shared by tests: tiny models and calibration tokens."""

import torch

ARCHS = ["tiny-llama-random", "tiny-qwen2-random", "tiny-mistral-random"]


def tiny(name: str, seed: int = 0):
    from taylor_tune.models import load_model

    return load_model(name, device="cpu", dtype=torch.float32, seed=seed)


def calibration_ids(num_samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    from taylor_tune.calibration import load_calibration
    from taylor_tune.models import byte_tokenizer

    return load_calibration(byte_tokenizer(), "sample", seq_len=seq_len, num_samples=num_samples, seed=seed)
