"""What a trial's stages share: the trial's settings (`TrialConfig`), the state its stages build (`TrialRun`) and
the shape of one stage (`Stage`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from taylor_tune.config import EXPERT_FIELDS, UNREAD_BY_EXPERTS, Evaluation, PruneConfig, RecoverySpec, recovery_of
from taylor_tune.evaluation.evaluate import Evaluator, PerplexityResult, ZeroShotResult
from taylor_tune.jsonio import json_safe
from taylor_tune.pruning.prune import Pruning
from taylor_tune.schema import DIMENSIONS
from taylor_tune.storage.cache import Leases, Store, StoreStats
from taylor_tune.sweep.racing import Blocks


class TrialConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    prune: PruneConfig
    evaluation: Evaluation
    sample_counts: tuple[int, ...] = ()  # every num_samples of the search: one cached pass serves them all
    cache_dir: str | None = None
    recovery: RecoverySpec | None = None  # LoRA recovery between pruning and evaluation (None: off)

    def record(self) -> dict:
        """The trial's config.json: every field, but `recovery` only when set, the evaluation's `item_seed` only
        when not null and its `ppl_fidelities` only when not the one pass over every window (so that the record of a
        trial without them is what it was before they existed, and a finished trial of an older sweep is found
        finished)."""
        exclude: dict = {"recovery": True} if self.recovery is None else {}
        # defaults left out as before the settings existed (streaming auto, the experts method's own fields), and the
        # dense settings the experts method does not read
        experts = self.prune.method == "experts"
        exclude["prune"] = ({"streaming"} if self.prune.streaming == "auto" else set()) | (
            set(UNREAD_BY_EXPERTS) if experts else set(EXPERT_FIELDS))
        exclude["evaluation"] = ({"item_seed"} if self.evaluation.item_seed is None else set()) | (
            {"ppl_fidelities"} if self.evaluation.ppl_fidelities == (None,) else set())
        return json.loads(json.dumps(json_safe(self.model_dump(exclude=exclude))))

    @classmethod
    def from_params(cls, config: dict) -> TrialConfig:
        """The trial Tune runs for one point of the search (its `params.json`: the searched values, the model and
        seed, and the experiment's fixed settings under `fixed`)."""
        fixed = config["fixed"]
        searched = {DIMENSIONS[name]: config[name] for name in DIMENSIONS if name in config}
        prune = PruneConfig(model=config["model"], seed=config["seed"], **fixed["prune"], **searched)
        return cls(
            prune=prune,
            evaluation=Evaluation.stored(fixed["evaluation"]),
            sample_counts=tuple(fixed["sample_counts"]),
            cache_dir=fixed["cache_dir"],
            recovery=recovery_of(fixed.get("recovery"), config),  # with the searched recovery dimensions
        )

    @classmethod
    def from_record(cls, record: object) -> TrialConfig:
        """`record()` read back (config.json, validated field by field): a record without `item_seed`, written before
        it existed, scored lm-eval's first N documents (`Evaluation.stored`)."""
        if isinstance(record, dict) and isinstance(record.get("evaluation"), dict):
            record = {**record, "evaluation": {"item_seed": None, **record["evaluation"]}}
        return cls.model_validate(record)


@dataclass
class TrialRun:
    """What a trial's stages share: its settings, the pruning they build, and the metrics so far."""

    trial: TrialConfig
    trial_dir: Path
    metrics: dict[str, Any]
    pruning: Pruning | None = None
    peak_gpu_bytes: int = 0  # the trial's GPU peak before the speed stage loaded the unpruned model beside it
    evaluator: Evaluator | None = None
    blocks: Blocks | None = None  # the seeded items of the zero-shot passes (`evaluation.pass_items`), drawn once
    shots: ZeroShotResult | None = None  # the last zero-shot pass: the items the next one adds to
    windows: Blocks | None = None  # the perplexity passes' windows (`evaluation.pass_windows`), drawn once
    ppl: PerplexityResult | None = None  # the last perplexity pass: the windows the next one adds to
    report: Callable[[dict], None] = lambda metrics: None  # what Tune hears (run_trial's `report`)
    on_gpu: bool = False
    leases: Leases | None = None  # who builds a shared entry (Ray's lease actor in a sweep)
    copies: Path | None = None  # this node's copies of entries read from object storage
    store_stats: StoreStats = field(default_factory=StoreStats)
    scratch: Path | None = None  # a streamed trial's folder outside its own (its pruned model), removed at its end

    def store(self, folder: str) -> Store | None:
        """The sweep's shared folder `folder` (importance_cache, requests, paired_speed), in the sweep's storage
        beside the importance cache; None when the sweep keeps no shared caches."""
        if self.trial.cache_dir is None:
            return None
        root = self.trial.cache_dir.rstrip("/").rsplit("/", 1)[0]
        return Store(f"{root}/{folder}", leases=self.leases, copies=self.copies, stats=self.store_stats)

    @property
    def config(self) -> PruneConfig:
        return self.trial.prune


@dataclass(frozen=True)
class Stage:
    """One step of a trial: `run` adds its metrics (and seconds) to the trial's; `reports`: Tune hears the metrics
    after it (a step ASHA may stop the trial at)."""

    name: str
    run: Callable[[TrialRun], dict | None]
    reports: bool = False
