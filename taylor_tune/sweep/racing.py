"""Racing on shared items (issue 66): which items each block scores, and whether a trial goes on after a block.
Pure: no torch, no Ray; the scheduler and the trainable hold a `Race` and `Blocks`.

Blocks. Every task's items are put in one seeded order per sweep and model (`race_seed`), the same for every trial of
that model, and scored in growing blocks: after block k a trial has scored the first `sizes[k]` items of that order in
every task (all of a task's items when it has fewer), the last block every item. A prefix of a random order is a fair
sample of the task, unlike lm-eval's `limit` (the first documents in the file's order), and two trials at the same
block have scored the same items, so their comparison is paired.

Decisions. After each block a trial is compared with the incumbent on the items both have scored, with the paired
machinery of the report (`taylor_tune.paired`: acc_mean's task-stratified paired difference, or log perplexity paired by
window). The incumbent is the best trial among those that have scored the most items (ties: the smaller trial id). A
trial other than the incumbent stops when it is worse at one-sided level `alpha`: its difference from the incumbent is
below zero by more than z_(1-alpha) standard errors (a zero standard error separates any nonzero difference, as in the
report). Blocks are nested prefixes of one order, so a trial's items are always among the incumbent's (the incumbent
has scored at least as many): the comparison is on exactly the trial's items.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np
import pandas as pd

from taylor_tune.paired import PairedDifference, paired_difference, paired_log_ppl
from taylor_tune.schema import RACE_OBJECTIVES


def race_seed(seed: int, model: str) -> int:
    """The items' order for one model of a sweep: stable across processes and Python versions (not `hash`)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{model}".encode()).digest()[:8], "little")


@dataclass(frozen=True)
class Blocks:
    """Each task's item indices in the race's order and the cumulative items per task after each block."""

    order: Mapping[str, tuple[int, ...]]
    sizes: tuple[int, ...]

    @classmethod
    def plan(cls, task_sizes: Mapping[str, int], sizes: Sequence[int], seed: int) -> Blocks:
        """`task_sizes`: task -> its item count; `sizes`: items per task after each block, increasing (a size past a
        task's count means all of it; the last block always covers every item)."""
        sizes = tuple(int(s) for s in sizes)
        if not sizes or any(s <= 0 for s in sizes) or any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"block sizes must be positive and increasing, got {list(sizes)}")
        rng = np.random.default_rng(seed)
        order = {task: tuple(int(i) for i in rng.permutation(count)) for task, count in sorted(task_sizes.items())}
        return cls(order, sizes)

    @property
    def count(self) -> int:
        return len(self.sizes)

    def _cut(self, block: int, task: str) -> int:
        if not 0 <= block < self.count:
            raise IndexError(f"block {block} of {self.count}")
        return len(self.order[task]) if block == self.count - 1 else min(self.sizes[block], len(self.order[task]))

    def items(self, block: int) -> dict[str, list[int]]:
        """Every item a trial has scored after `block` (0-based), per task: lm-eval's `samples` for the blocks so
        far."""
        return {task: list(order[: self._cut(block, task)]) for task, order in self.order.items()}

    def new_items(self, block: int) -> dict[str, list[int]]:
        """The items `block` adds to the ones before it."""
        start = {task: 0 for task in self.order} if block == 0 else {t: self._cut(block - 1, t) for t in self.order}
        return {task: list(order[start[task]: self._cut(block, task)]) for task, order in self.order.items()}

    def scored(self, block: int) -> int:
        return sum(self._cut(block, task) for task in self.order)


@dataclass(frozen=True)
class Decision:
    """What a race decided for a trial after a block."""

    trial: str
    block: int  # 0-based
    items: int  # items (or windows) the comparison rests on
    go_on: bool
    incumbent: str | None  # None: the trial is the incumbent
    difference: float | None = None  # trial - incumbent (acc_mean; for ppl: incumbent's log ppl - trial's), > 0 better
    stderr: float | None = None

    def says(self, objective: str = "acc_mean") -> str:
        """One line for the report: why a trial stopped, or that it went on."""
        if self.incumbent is None:
            return f"leads after block {self.block + 1} ({self.items} items)"
        gap = f"{abs(self.difference):.3f} ± {self.stderr:.3f}"
        unit = "" if objective == "acc_mean" else " in log ppl"
        if self.go_on:
            return f"went on after block {self.block + 1}: {gap}{unit} from {self.incumbent}, paired, not separated"
        return f"raced out at block {self.block + 1}, worse than {self.incumbent} by {gap}{unit}, paired"


@dataclass
class Race:
    """One model's race: every trial's outcomes so far, and each decision. Plain data, so that it pickles with the
    scheduler that holds it."""

    alpha: float = 0.05
    objective: str = "acc_mean"
    outcomes: dict[str, pd.Series | pd.DataFrame] = field(default_factory=dict)  # trial -> its items so far
    decisions: list[Decision] = field(default_factory=list)

    def __post_init__(self):
        if self.objective not in RACE_OBJECTIVES:
            raise ValueError(f"objective: a race compares {' or '.join(RACE_OBJECTIVES)}, not {self.objective!r}")
        if not 0 < self.alpha < 0.5:
            raise ValueError(f"alpha must lie in (0, 0.5), got {self.alpha}")

    @property
    def z(self) -> float:
        return NormalDist().inv_cdf(1 - self.alpha)

    def _score(self, trial: str) -> float:
        data = self.outcomes[trial]
        if self.objective == "acc_mean":
            return float(data.groupby(level=0).mean().mean())
        return -float(data["nll"].sum() / data["tokens"].sum())  # minus log ppl: higher is better

    def _size(self, trial: str) -> int:
        return len(self.outcomes[trial])

    def incumbent(self) -> str | None:
        """The best trial among those that have scored the most items; ties go to the smaller trial id."""
        if not self.outcomes:
            return None
        most = max(self._size(t) for t in self.outcomes)
        leaders = sorted(t for t in self.outcomes if self._size(t) == most)
        best = leaders[0]
        for trial in leaders[1:]:
            if self._score(trial) > self._score(best):
                best = trial
        return best

    def compare(self, trial: str, other: str) -> PairedDifference | None:
        """trial against other on the trial's items (all of which `other` has scored), better > 0."""
        mine, theirs = self.outcomes[trial], self.outcomes[other]
        if not mine.index.isin(theirs.index).all():
            return None
        theirs = theirs.loc[mine.index]
        if self.objective == "acc_mean":
            return paired_difference(mine, theirs)
        return paired_log_ppl(theirs, mine)  # incumbent minus trial in log ppl: > 0 when the trial is better

    def record(self, trial: str, block: int, outcomes: pd.Series | pd.DataFrame) -> Decision:
        """The trial's items after `block` (all of them so far: acc_mean's 0/1 outcomes indexed by (task, doc_id), or
        perplexity's windows with nll and tokens); returns whether it goes on."""
        self.outcomes[trial] = outcomes
        leader = self.incumbent()
        if leader == trial:
            decision = Decision(trial, block, self._size(trial), True, None)
        else:
            found = self.compare(trial, leader)
            if found is None:  # not on shared items: nothing to decide on, the trial goes on
                decision = Decision(trial, block, self._size(trial), True, leader)
            else:
                worse = found.difference < 0 and found.separated(self.z)
                decision = Decision(trial, block, found.items, not worse, leader, found.difference, found.stderr)
        # a trial that runs again after a resume (it was in flight when the driver died) records its blocks again:
        # the same block's decision replaces the first, so that the race reads as one uninterrupted run
        again = next((i for i, d in enumerate(self.decisions) if (d.trial, d.block) == (trial, block)), None)
        if again is None:
            self.decisions.append(decision)
        else:
            self.decisions[again] = decision
        return decision
