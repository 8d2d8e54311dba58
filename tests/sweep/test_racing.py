"""Racing's decisions (issue 66, must-show 1) on constructed per-item data, against the paired test written out here
with numpy: which block a worse trial stops at, that ties go on, that the incumbent changes, that a pickled race
decides as the original, and the blocks' items."""

import math
import pickle

import numpy as np
import pandas as pd
import pytest

from taylor_tune.sweep.racing import Blocks, Decision, Race, race_seed

TASKS = {"boolq": 300, "piqa": 250, "arc_easy": 200}
SIZES = (20, 50, 100, 300)
Z95_ONE_SIDED = 1.6448536269514722  # the standard normal's 0.95 quantile


def outcomes(values: dict[str, np.ndarray], items: dict[str, list[int]]) -> pd.Series:
    """The 0/1 outcomes of `items` (task -> doc ids), from each task's full vector of outcomes by doc id."""
    return pd.concat([pd.Series(values[t][ids].astype(float),
                                index=pd.MultiIndex.from_tuples([(t, i) for i in ids], names=["task", "doc_id"]))
                      for t, ids in items.items()])


def reference(mine: dict[str, np.ndarray], theirs: dict[str, np.ndarray], items: dict[str, list[int]]):
    """The paired test written out: per task the mean and variance (ddof 1) of the item differences, acc_mean's
    difference the mean of the task means, its standard error sqrt(sum var_t / n_t) / T; worse when the difference
    is below zero by more than z standard errors (a zero error: any negative difference)."""
    means, variances = [], []
    for task, ids in items.items():
        d = mine[task][ids].astype(float) - theirs[task][ids].astype(float)
        means.append(d.mean())
        variances.append(d.var(ddof=1) / len(d))
    difference, stderr = float(np.mean(means)), math.sqrt(sum(variances)) / len(means)
    return difference, stderr, difference < 0 and (stderr == 0 or -difference > Z95_ONE_SIDED * stderr)


def scores(rng, p: float) -> dict[str, np.ndarray]:
    return {t: (rng.random(n) < p).astype(int) for t, n in TASKS.items()}


def worse_copy(rng, base: dict[str, np.ndarray], lose: float, gain: float) -> dict[str, np.ndarray]:
    """`base` with a share `lose` of its right answers made wrong and `gain` of its wrong ones right: correlated with
    it item by item, as two prunings of one model are."""
    out = {}
    for task, v in base.items():
        flip = rng.random(len(v))
        out[task] = np.where(v == 1, (flip >= lose).astype(int), (flip < gain).astype(int))
    return out


@pytest.fixture
def blocks():
    return Blocks.plan(TASKS, SIZES, seed=race_seed(0, "smollm2-135m"))


def run_to_end(race: Race, trial: str, values, blocks: Blocks):
    decisions = []
    for block in range(blocks.count):
        decisions.append(race.record(trial, block, outcomes(values, blocks.items(block))))
        if not decisions[-1].go_on:
            break
    return decisions


@pytest.mark.parametrize("seed", range(6))
def test_a_worse_trial_stops_at_the_first_block_where_the_written_out_test_rejects(blocks, seed):
    rng = np.random.default_rng(seed)
    best = scores(rng, 0.7)
    worse = worse_copy(rng, best, lose=0.12, gain=0.03)
    race = Race(alpha=0.05)
    assert all(d.go_on for d in run_to_end(race, "a", best, blocks))
    expected = [reference(worse, best, blocks.items(k)) for k in range(blocks.count)]
    first = next(k for k, (_, _, stop) in enumerate(expected) if stop)  # the margin is large enough to reject
    decisions = run_to_end(race, "b", worse, blocks)
    assert [d.block for d in decisions] == list(range(first + 1))
    assert [d.go_on for d in decisions] == [True] * first + [False]
    stop = decisions[-1]
    assert stop.incumbent == "a" and stop.items == sum(len(v) for v in blocks.items(first).values())
    assert stop.difference == pytest.approx(expected[first][0], abs=1e-12)
    assert stop.stderr == pytest.approx(expected[first][1], rel=1e-9)
    assert stop.says().startswith(f"raced out at block {first + 1}, worse than a by ")


def test_trials_that_tie_go_on_to_the_last_block(blocks):
    """The same outcomes item for item (difference 0, standard error 0): never separated."""
    rng = np.random.default_rng(1)
    best = scores(rng, 0.6)
    race = Race()
    run_to_end(race, "a", best, blocks)
    same = run_to_end(race, "b", best, blocks)
    assert len(same) == blocks.count and all(d.go_on for d in same)
    assert all(d.difference == 0 and d.stderr == 0 for d in same if d.incumbent is not None)


def test_a_trial_not_worse_than_the_incumbent_goes_on_whatever_its_sign(blocks):
    """Slightly worse but within the noise at every block (checked against the written-out test): never stopped."""
    rng = np.random.default_rng(7)
    best = scores(rng, 0.6)
    close = worse_copy(rng, best, lose=0.02, gain=0.03)  # as many lost as won, on average
    assert not any(reference(close, best, blocks.items(k))[2] for k in range(blocks.count))
    race = Race()
    run_to_end(race, "a", best, blocks)
    assert all(d.go_on for d in run_to_end(race, "b", close, blocks))


def test_the_incumbent_is_the_best_of_those_that_scored_the_most_items_and_changes_when_a_better_one_appears(blocks):
    rng = np.random.default_rng(3)
    first = scores(rng, 0.55)
    better = {t: np.maximum(v, (rng.random(len(v)) < 0.4).astype(int)) for t, v in first.items()}  # never worse
    worse = worse_copy(rng, better, lose=0.3, gain=0.0)
    race = Race()
    run_to_end(race, "a", first, blocks)
    assert race.incumbent() == "a"
    race.record("b", 0, outcomes(better, blocks.items(0)))
    assert race.incumbent() == "a"  # better on its block, but "a" has scored more items
    for block in range(1, blocks.count):
        decision = race.record("b", block, outcomes(better, blocks.items(block)))
    assert decision.incumbent is None and race.incumbent() == "b"  # now as many items and the better score
    decisions = run_to_end(race, "c", worse, blocks)
    assert {d.incumbent for d in decisions} == {"b"} and not decisions[-1].go_on


def test_ties_at_the_top_go_to_the_smaller_trial_id(blocks):
    rng = np.random.default_rng(4)
    values = scores(rng, 0.5)
    race = Race()
    run_to_end(race, "trial_00002", values, blocks)
    run_to_end(race, "trial_00001", values, blocks)
    assert race.incumbent() == "trial_00001"


def test_a_pickled_race_decides_as_the_original(blocks):
    rng = np.random.default_rng(5)
    best = scores(rng, 0.7)
    others = [worse_copy(rng, best, lose=share, gain=0.02) for share in (0.05, 0.1, 0.2)]
    race = Race(alpha=0.1)
    run_to_end(race, "a", best, blocks)
    for index, values in enumerate(others):
        race.record(f"t{index}", 0, outcomes(values, blocks.items(0)))
    copy = pickle.loads(pickle.dumps(race))
    for block in range(1, blocks.count):
        for index, values in enumerate(others):
            if race.decisions and any(d.trial == f"t{index}" and not d.go_on for d in race.decisions):
                continue
            assert race.record(f"t{index}", block, outcomes(values, blocks.items(block))) == copy.record(
                f"t{index}", block, outcomes(values, blocks.items(block)))
    assert race.decisions == copy.decisions and race.incumbent() == copy.incumbent()


def test_perplexity_races_on_its_windows_against_the_written_out_ratio():
    """log ppl paired by window: (sum of the incumbent's NLL - sum of the trial's) / tokens, its standard error from
    the windows (the delta method for a ratio), one-sided at alpha."""
    rng = np.random.default_rng(6)
    windows = 64
    tokens = rng.integers(100, 128, windows).astype(float)
    base = tokens * rng.normal(3.0, 0.3, windows)
    worse = base + tokens * rng.normal(0.02, 0.02, windows)

    def frame(nll, upto):
        return pd.DataFrame({"nll": nll[:upto], "tokens": tokens[:upto]}, index=pd.RangeIndex(upto, name="window"))

    race = Race(objective="ppl")
    sizes = (8, 16, 32, 64)
    for block, upto in enumerate(sizes):
        race.record("a", block, frame(base, upto))
    for block, upto in enumerate(sizes):
        d_w = base[:upto] - worse[:upto]
        difference = d_w.sum() / tokens[:upto].sum()
        resid = d_w - difference * tokens[:upto]
        stderr = math.sqrt((resid ** 2).sum() * upto / (upto - 1)) / tokens[:upto].sum()
        decision = race.record("b", block, frame(worse, upto))
        assert decision.difference == pytest.approx(difference, rel=1e-9)
        assert decision.stderr == pytest.approx(stderr, rel=1e-9)
        assert decision.go_on == (not (difference < 0 and -difference > Z95_ONE_SIDED * stderr))
        if not decision.go_on:
            break
    assert not decision.go_on and "in log ppl" in decision.says("ppl")


def test_blocks_are_nested_prefixes_of_one_seeded_order_and_the_last_covers_every_item():
    blocks = Blocks.plan(TASKS, SIZES, seed=11)
    again = Blocks.plan(TASKS, SIZES, seed=11)
    other = Blocks.plan(TASKS, SIZES, seed=12)
    assert blocks == again and blocks.order != other.order
    for task, count in TASKS.items():
        assert sorted(blocks.order[task]) == list(range(count))  # a permutation of the task's items
        assert blocks.order[task][:20] != tuple(range(20))  # not lm-eval's first documents
    for k in range(blocks.count):
        items = blocks.items(k)
        for task in TASKS:
            assert items[task] == list(blocks.order[task][: len(items[task])])
            assert len(items[task]) == (TASKS[task] if k == blocks.count - 1 else min(SIZES[k], TASKS[task]))
        added = blocks.new_items(k)
        before = blocks.items(k - 1) if k else {t: [] for t in TASKS}
        assert all(before[t] + added[t] == items[t] for t in TASKS)
    assert blocks.scored(blocks.count - 1) == sum(TASKS.values())
    short = Blocks.plan({"boolq": 300}, (10, 1000), seed=1)  # a size past the task: all of it, the last block too
    assert len(short.items(0)["boolq"]) == 10 and len(short.items(1)["boolq"]) == 300


@pytest.mark.parametrize("sizes", [(), (0, 10), (20, 10), (10, 10)])
def test_block_sizes_must_be_positive_and_increasing(sizes):
    with pytest.raises(ValueError, match="block sizes must be positive and increasing"):
        Blocks.plan(TASKS, sizes, seed=0)


def test_the_order_is_the_models_own_and_stable():
    assert race_seed(0, "smollm2-135m") == race_seed(0, "smollm2-135m")
    assert len({race_seed(0, "smollm2-135m"), race_seed(0, "qwen2.5-0.5b"), race_seed(1, "smollm2-135m")}) == 3
    with pytest.raises(ValueError, match="objective: a race compares acc_mean or ppl"):
        Race(objective="decode_speedup")


def test_the_order_seed_blocks_and_level_are_what_they_are_written_to_be():
    """The items' seed is the first 8 bytes of sha256("seed:model"), little-endian (written out); a block of one item
    is a block; there is no block past the last; the level lies strictly between 0 and 0.5."""
    import hashlib

    assert race_seed(3, "tiny-llama") == int.from_bytes(hashlib.sha256(b"3:tiny-llama").digest()[:8], "little")
    blocks = Blocks.plan({"piqa": 5}, (1, 3), seed=0)
    assert [len(blocks.items(b)["piqa"]) for b in range(2)] == [1, 5]
    with pytest.raises(IndexError, match="block 2 of 2"):
        blocks.items(2)
    for alpha in (0.0, 0.5, 0.7):
        with pytest.raises(ValueError, match="alpha must lie in"):
            Race(alpha=alpha)


def test_the_incumbent_is_best_by_the_mean_of_task_means_and_each_decision_says_why():
    """Two trials on the same items: a is better in the mean of its task means (piqa 1.0, boolq 0.25: 0.625) and worse
    in the mean over all items (6/10 against b's 7/10: boolq has more items), so a leads. The leader's decision names
    it with its items; the lines the report prints, for acc_mean (the default) and for ppl, written out."""
    index = pd.MultiIndex.from_tuples([("piqa", d) for d in range(2)] + [("boolq", d) for d in range(8)])
    a = pd.Series([1, 1, 1, 1, 0, 0, 0, 0, 0, 0], index=index, dtype=float)
    b = pd.Series([0, 0, 1, 1, 1, 1, 1, 1, 1, 0], index=index, dtype=float)
    assert a.mean() < b.mean() and (1.0 + 0.25) / 2 > (0.0 + 6 / 8) / 2  # the two means disagree
    race = Race()
    first = race.record("b", 0, b)
    assert (first.trial, first.items, first.incumbent, first.go_on) == ("b", 10, None, True)
    assert first.says() == "leads after block 1 (10 items)"
    race.record("a", 0, a)
    assert race.incumbent() == "a"
    went_on = Decision("c", 1, 10, True, "a", -0.0123, 0.0456)
    assert went_on.says() == "went on after block 2: 0.012 ± 0.046 from a, paired, not separated"
    assert went_on.says("ppl") == "went on after block 2: 0.012 ± 0.046 in log ppl from a, paired, not separated"
    out = Decision("c", 0, 10, False, "a", -0.031, 0.009)
    assert out.says() == "raced out at block 1, worse than a by 0.031 ± 0.009, paired"
