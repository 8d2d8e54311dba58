"""A cache of importance passes, shared by every trial of a sweep, on every node, in the sweep's storage
(`storage.cache.Store`: a local folder or object storage).

Key: the fields the caller gives (the trial: model, resolved calibration text, seq_len, seed, the dtype and device
type the model was loaded in, micro-batch size) and every sample count the entry holds. One entry holds the scores at
every sample count of the search (one nested pass gives them all), so methods and sample counts share it.

Each entry is computed once across all trials: the store's lease decides who computes (Ray's lease actor in a sweep,
a lock file with a heartbeat on a local folder without Ray) and the others wait, then read. An entry is a
safetensors file written whole, carrying the sha256 of its tensors in its metadata; an entry that does not read back,
does not match its checksum, or fails the caller's check (the scores' shapes for the model, finite, non-negative) is
removed and computed again once, logged as a `damaged` event: never used. Every hit and every computed pass is an
event in the store (`counters`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load, save

from taylor_tune.jsonio import digest
from taylor_tune.pruning.activations import ActivationStats, FeatureStats
from taylor_tune.pruning.importance import Importance
from taylor_tune.pruning.plan import GroupScores
from taylor_tune.storage.cache import FileLeases, Store, counters

log = logging.getLogger(__name__)


def cache_key(**fields) -> str:
    return digest(fields)[:24]


CHECKSUM = "taylor_tune_sha256"


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of every tensor's name, dtype, shape and bytes, in name order."""
    digest_ = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest_.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest_.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest_.hexdigest()


def read_checked(data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of an entry (safetensors bytes) whose checksum matches them (ValueError otherwise: cut short,
    changed, or written without one)."""
    (size,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8:8 + size]).get("__metadata__") or {}
    tensors = load(data)
    recorded = metadata.get(CHECKSUM)
    if recorded != tensors_sha256(tensors):
        raise ValueError("its tensors do not match their checksum" if recorded else "it carries no checksum")
    return tensors


def _to_tensors(results: dict[int, Importance]) -> dict[str, torch.Tensor]:
    tensors = {}
    for n, imp in results.items():
        for layer, (a, m) in enumerate(zip(imp.scores.attn, imp.scores.mlp)):
            tensors[f"n{n}.layers.{layer}.attention_scores"] = torch.from_numpy(np.ascontiguousarray(a))
            tensors[f"n{n}.layers.{layer}.mlp_scores"] = torch.from_numpy(np.ascontiguousarray(m))
        tensors[f"n{n}.layer_grad_mean"] = torch.from_numpy(np.ascontiguousarray(imp.grad_mean))
        tensors[f"n{n}.layer_grad_norm"] = torch.from_numpy(np.ascontiguousarray(imp.grad_norm))
    return tensors


def _from_tensors(tensors: dict[str, torch.Tensor], counts: list[int]) -> dict[int, Importance]:
    results = {}
    for n in counts:
        layers = sum(1 for k in tensors if k.startswith(f"n{n}.layers.") and k.endswith(".mlp_scores"))
        scores = GroupScores(
            attn=tuple(tensors[f"n{n}.layers.{l}.attention_scores"].numpy() for l in range(layers)),
            mlp=tuple(tensors[f"n{n}.layers.{l}.mlp_scores"].numpy() for l in range(layers)),
        )
        results[n] = Importance(
            n, scores, tensors[f"n{n}.layer_grad_mean"].numpy(), tensors[f"n{n}.layer_grad_norm"].numpy()
        )
    return results


def stats_to_tensors(results: dict[int, ActivationStats]) -> dict[str, torch.Tensor]:
    """An activation-statistics entry (wanda_sp, flap): per count and layer, each projection's input statistics."""
    tensors = {}
    for n, stats in results.items():
        for layer, parts in enumerate(zip(stats.attn, stats.mlp)):
            for kind, part in zip(("attention", "mlp"), parts):
                prefix = f"n{n}.layers.{layer}.{kind}"
                tensors[f"{prefix}.mean"] = torch.from_numpy(np.ascontiguousarray(part.mean))
                tensors[f"{prefix}.m2"] = torch.from_numpy(np.ascontiguousarray(part.m2))
                tensors[f"{prefix}.tokens"] = torch.tensor([part.tokens], dtype=torch.int64)
    return tensors


def stats_from_tensors(tensors: dict[str, torch.Tensor], counts: list[int]) -> dict[int, ActivationStats]:
    results = {}
    for n in counts:
        layers = sum(1 for k in tensors if k.startswith(f"n{n}.layers.") and k.endswith(".mlp.mean"))

        def part(layer: int, kind: str, n=n) -> FeatureStats:
            prefix = f"n{n}.layers.{layer}.{kind}"
            return FeatureStats(int(tensors[f"{prefix}.tokens"][0]), tensors[f"{prefix}.mean"].numpy(),
                                tensors[f"{prefix}.m2"].numpy())

        results[n] = ActivationStats(attn=tuple(part(l, "attention") for l in range(layers)),
                                     mlp=tuple(part(l, "mlp") for l in range(layers)))
    return results


class ImportanceCache:
    def __init__(self, root: Store | str | Path, *, poll_s: float = 0.2, heartbeat_s: float = 5.0,
                 stale_s: float = 60.0):
        """`root`: a store (`storage.cache.Store`, with its leases and copies), or a local folder, coordinated by lock
        files (`storage.cache.FileLeases`: polled every `poll_s`, taken over when not refreshed for `stale_s`)."""
        self.store = root if isinstance(root, Store) else Store(
            root, leases=FileLeases(poll_s=poll_s, stale_s=stale_s), heartbeat_s=heartbeat_s)
        self.last_event: str | None = None  # what this object's latest call did: "hit" or "computed"

    def counters(self) -> dict[str, int]:
        return counters(self.store.events())

    def get_or_compute(self, fields: dict, counts: list[int], compute: Callable[[], dict[int, Importance]],
                       extra_tensors: Callable[[], dict[str, torch.Tensor]] | None = None,
                       check: Callable[[Importance], None] = lambda importance: None,
                       encode=_to_tensors, decode=_from_tensors) -> dict[int, Importance]:
        """The scores at every count in `counts`, computed at most once per key across all processes; a stored
        entry is used only when `check` (raising on what the caller cannot use) passes at every count.
        `encode` / `decode`: how an entry's values become tensors and back (gradient importance by default; the
        activation statistics with stats_to_tensors / stats_from_tensors, under keys of their own)."""
        key = cache_key(**fields, counts=sorted(counts))

        computed = {}

        def build() -> bytes:
            computed["results"] = compute()
            tensors = encode(computed["results"]) | (extra_tensors() if extra_tensors else {})
            return save(tensors, metadata={**{k: str(v) for k, v in fields.items()},
                                           CHECKSUM: tensors_sha256(tensors)})

        def use(data: bytes) -> dict[int, Importance]:
            results = decode(read_checked(data), counts)
            for importance in results.values():
                check(importance)
            return results

        results, self.last_event = self.store.built_once(
            f"{key}.safetensors", build, use, {k: str(v) for k, v in fields.items()},
            made=lambda data: computed["results"])  # computed here: as the pass gave them
        return results
