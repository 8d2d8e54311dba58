"""A file cache of importance passes, shared by every trial of a sweep (and across nodes on shared storage).

Key: the fields the caller gives (the trial: model, resolved calibration text, seq_len, seed, the dtype and device
type the model was loaded in, micro-batch size) and every sample count the entry holds. One entry holds the scores at
every sample count of the search (one nested pass gives them all), so methods and sample counts share it.

Concurrency: the first trial to ask creates `<key>.lock` with O_EXCL and computes; the others wait for the
entry to appear. The owner refreshes the lock's mtime while it works (a heartbeat), so a lock left by a
killed owner goes stale and another trial takes over. Entries are written to a temporary name and renamed
into place, so a kill never leaves a partial entry that a later trial would read. Each entry carries the sha256 of
its tensors in its metadata; an entry that does not read back, does not match its checksum, or fails the caller's
check (the scores' shapes for the model, finite, non-negative) is removed and computed again once, logged as a
`damaged` event: never used. Every hit and every computed pass is appended to `events.jsonl` (opened without
following a link): the cache's own counters.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from taylor_tune.jsonio import digest, open_own
from taylor_tune.pruning.activations import ActivationStats, FeatureStats
from taylor_tune.pruning.importance import Importance
from taylor_tune.pruning.plan import GroupScores

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


def read_checked(entry: Path) -> dict[str, torch.Tensor]:
    """The tensors of an entry whose checksum matches them (ValueError otherwise: cut short, changed, or written
    without one)."""
    with safe_open(str(entry), framework="pt") as handle:
        recorded = (handle.metadata() or {}).get(CHECKSUM)
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
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
    def __init__(self, root: str | Path, *, poll_s: float = 0.2, heartbeat_s: float = 5.0, stale_s: float = 60.0):
        self.root = Path(root)
        self.poll_s, self.heartbeat_s, self.stale_s = poll_s, heartbeat_s, stale_s
        self.last_event: str | None = None  # what this object's latest call did: "hit", "computed" or "takeover"

    def _record(self, event: str, key: str, **extra) -> None:
        self.last_event = event
        line = json.dumps({"event": event, "key": key, "time": time.time(), "host": socket.gethostname(),
                           "pid": os.getpid(), **extra}) + "\n"
        with os.fdopen(open_own(self.root / "events.jsonl", os.O_WRONLY | os.O_APPEND), "a") as f:
            f.write(line)  # one short O_APPEND write per event

    def counters(self) -> dict[str, int]:
        path = self.root / "events.jsonl"
        events = [json.loads(l) for l in path.read_text().splitlines()] if path.is_file() else []
        return {
            "computed": sum(e["event"] == "computed" for e in events),
            "hits": sum(e["event"] == "hit" for e in events),
            "takeovers": sum(e["event"] == "takeover" for e in events),
        }

    def get_or_compute(self, fields: dict, counts: list[int], compute: Callable[[], dict[int, Importance]],
                       extra_tensors: Callable[[], dict[str, torch.Tensor]] | None = None,
                       check: Callable[[Importance], None] = lambda importance: None,
                       encode=_to_tensors, decode=_from_tensors) -> dict[int, Importance]:
        """The scores at every count in `counts`, computed at most once per key across all processes; a stored
        entry is used only when `check` (raising on what the caller cannot use) passes at every count.
        `encode` / `decode`: how an entry's values become tensors and back (gradient importance by default; the
        activation statistics with stats_to_tensors / stats_from_tensors, under keys of their own)."""
        self.root.mkdir(parents=True, exist_ok=True)
        key = cache_key(**fields, counts=sorted(counts))
        entry, lock = self.root / f"{key}.safetensors", self.root / f"{key}.lock"
        damaged = False
        while True:
            if entry.is_file():
                try:
                    results = decode(read_checked(entry), counts)
                    for importance in results.values():
                        check(importance)
                except Exception as error:  # damaged: safetensors, OSError, a missing tensor, checksum, check
                    # removed and computed again, once: a second damaged entry is not a state to loop on
                    if damaged:
                        raise
                    damaged = True
                    log.warning("importance cache: entry %s does not read back (%s: %s); computing it again",
                                entry.name, type(error).__name__, error)
                    self._record("damaged", key, error=f"{type(error).__name__}: {error}")
                    entry.unlink(missing_ok=True)
                    continue
                self._record("hit", key)
                return results
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                if self._stale(lock):
                    self._record("takeover", key)
                    lock.unlink(missing_ok=True)
                else:
                    time.sleep(self.poll_s)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
            if entry.is_file():  # written (and its lock let go) between the look above and taking the lock: read it
                lock.unlink(missing_ok=True)
                continue
            return self._compute(key, fields, entry, lock, compute, extra_tensors, encode)

    def _stale(self, lock: Path) -> bool:
        try:
            return time.time() - lock.stat().st_mtime > self.stale_s
        except FileNotFoundError:
            return False

    def _compute(self, key, fields, entry, lock, compute, extra_tensors, encode):
        stop = threading.Event()

        def heartbeat() -> None:
            while not stop.wait(self.heartbeat_s):
                try:
                    os.utime(lock)
                except FileNotFoundError:
                    return

        beat = threading.Thread(target=heartbeat, daemon=True)
        beat.start()
        try:
            start = time.perf_counter()
            results = compute()
            tensors = encode(results) | (extra_tensors() if extra_tensors else {})
            tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
            tmp.unlink(missing_ok=True)  # a leftover, or a link planted under the name
            save_file(tensors, str(tmp), metadata={**{k: str(v) for k, v in fields.items()},
                                                   CHECKSUM: tensors_sha256(tensors)})
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, entry)  # atomic: readers see no entry or a whole one
            self._record("computed", key, seconds=time.perf_counter() - start, **{k: str(v) for k, v in fields.items()})
            return results
        finally:
            stop.set()
            lock.unlink(missing_ok=True)
