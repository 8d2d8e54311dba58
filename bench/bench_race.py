"""Racing against the other searches (issue 66, must-show 3): replayed offline on complete grids with per-item outcomes.

Input: a finished grid sweep whose every trial kept its per-item outcomes of one zero-shot pass over a population of
items (e.g. `fidelities: [300]`: 300 items of each of the seven tasks). The population is what the replays race on:
each replay seed draws the blocks (`racing.Blocks`, the product's own, over the population) and an order of the
configurations, then runs, by lookup, one trial at a time:
- grid: every configuration on every item;
- random: `--budget` configurations drawn at random, each on every item, the best picked;
- asha: the grid, each trial on the blocks in turn, `FidelityASHA` (the product's) stopping it at a block;
- tpe_asha: the product's `PerModelSearcher` (TPE) proposing `--budget` trials, with ASHA on the blocks;
- race: the grid, each trial raced block by block by the product's `Race` at `--alpha`;
- tpe_race: TPE proposing `--budget` trials, each raced.
A search's pick: the best configuration it scored on every item (a race's incumbent). It is in the band when the
paired test on all items (`reporting.paired.paired_difference`, two-sided 95%) does not separate it from the grid's
best; its regret is the acc_mean on all items it gives up against that best. The searched dimensions are the trials'
own (params.json): the paper grid's, or any other grid's (the Qwen space's method x criterion x depth_share).
Cost: seconds, from the sweep's own measurements: each trial's load and prune seconds (and a mixed cut's layer
measure, similarity_s: each trial's own), each importance pass once per search (the sweep's cache: one per seq_len
and kind of statistics, gradients or activations), and each item scored at the grid's median seconds per item. A
pass scores only the items its block adds to the one before (`--cost added`: what the product's passes do), or, as a
what-if, every item of its block again (`--cost rescored`: what they did before passes kept the earlier blocks'
outcomes).

    .venv/bin/python bench/bench_race.py /tmp/s7/sweeps/race_paper_grid --blocks 25,75 --alpha 0.05 \
        --json bench/race_smollm2.json
    .venv/bin/python bench/bench_race.py /tmp/s7/sweeps/race_paper_grid --only taylor_seq_len=16,32   # a sub-grid

A grid whose trials ran on different machines measured its seconds at different rates: `--rates FILE` (JSON:
{"item_s": seconds per item, "importance_s": {seq_len: seconds of its importance pass}}, measured on one machine)
prices every search with those instead, each trial's own load and prune seconds aside.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from statistics import NormalDist
from types import SimpleNamespace

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from taylor_tune.config import Evaluation  # noqa: E402
from taylor_tune.jsonio import write_json  # noqa: E402
from taylor_tune.paired import paired_difference  # noqa: E402
from taylor_tune.pruning.activations import ACTIVATION_CRITERIA  # noqa: E402
from taylor_tune.storage.cache import Store
from taylor_tune.storage.folder import read_outcomes  # noqa: E402
from taylor_tune.sweep.racing import Blocks, Race, race_seed  # noqa: E402
from taylor_tune.sweep.tune.scheduler import PASS, FidelityASHA, item_scores  # noqa: E402
from taylor_tune.sweep.tune.search import PerModelSearcher  # noqa: E402

NAMES = ("taylor_seq_len", "taylor_num_samples", "pruning_method")  # the paper grid's, in its order
NOT_SEARCHED = ("fixed", "model", "seed")  # a trial's params.json: what the sweep fixed, the model, the repeat
SEARCHES = ("grid", "random", "asha", "tpe_asha", "race", "tpe_race")


def dimensions(params: dict) -> tuple[str, ...]:
    """The searched dimensions of a trial's params.json, the paper grid's first in their order."""
    names = [name for name in params if name not in NOT_SEARCHED]
    return tuple(sorted(names, key=lambda name: (NAMES.index(name) if name in NAMES else len(NAMES), name)))


def grid_dimensions(path: Path) -> tuple[str, ...]:
    trials = sorted(p for p in path.iterdir() if (p / "params.json").is_file()) if path.is_dir() else []
    if not trials:
        raise SystemExit(f"{path}: no trial folder with a params.json")
    return dimensions(json.loads((trials[0] / "params.json").read_text()))


def pass_of(seq_len, criterion: str | None) -> tuple[int, str]:
    """The importance cache's pass a trial reads: one per seq_len and kind of statistics (gradients for the Taylor
    criteria, activations for wanda_sp and flap), at the sweep's largest sample count."""
    return int(seq_len), "activations" if criterion in ACTIVATION_CRITERIA else "gradients"


def load_grid(path: Path, only: dict[str, set] | None = None) -> dict:
    """configuration -> its items' scores (indexed by task, doc_id) and seconds; plus the importance passes'.
    `only`: {dimension: values} keeps the trials with those values (a complete sub-grid of a grid still running)."""
    configs, importance, per_item, names = {}, {}, [], None
    for trial in sorted(p for p in path.iterdir() if (p / "result.json").is_file()):
        rows = [json.loads(line) for line in (trial / "result.json").read_text().splitlines() if line.strip()]
        if not rows:  # a trial started, nothing reported yet: a missing configuration, refused below unless `only`
            continue
        last = rows[-1]
        if only and any(str(last.get(name)) not in values for name, values in only.items()):
            continue
        stage = last.get("stage", "")
        outcomes = read_outcomes(str(trial), stage) if stage.startswith("zero_shot_") else None
        if outcomes is None:
            raise SystemExit(f"{trial}: no per-item outcomes of its last pass; replay a finished grid kept with them")
        params = json.loads((trial / "params.json").read_text())
        if names is None:
            names = dimensions(params)
        elif dimensions(params) != names:
            raise SystemExit(f"{trial}: searched {dimensions(params)}, the grid's other trials {names}")
        evaluation = Evaluation.stored(params["fixed"]["evaluation"])
        scores = item_scores(outcomes, {task: evaluation.metric(task) for task in evaluation.tasks})
        key = tuple(last[name] for name in names)
        importance_pass = pass_of(last["taylor_seq_len"], last.get("criterion"))
        # a mixed cut's layer measure is the trial's own pass (never cached): paid by every trial, hit or not
        own_s = last["load_s"] + last["prune_s"] + last.get("similarity_s", 0.0)
        configs[key] = {"scores": scores, "prune_s": own_s, "pass": importance_pass}
        per_item.append(last[f"{stage}_s"] / len(scores))
        if last.get("importance_cache") == "computed":
            importance[importance_pass] = last["importance_s"] + last.get("calibration_s", 0.0)
    if names is None:
        raise SystemExit(f"{path}: no finished trial")
    product = math.prod(len({key[i] for key in configs}) for i in range(len(names)))
    if len(configs) != product:  # a search proposes from the domains' product: every point must be there
        raise SystemExit(f"{path}: {len(configs)} configurations kept, not the {product} of their grid; replay a "
                         "finished grid")
    for event in Store(path / "importance_cache").events():
        if event["event"] == "computed":
            kind = "activations" if event.get("statistics") == "activations" else "gradients"
            importance.setdefault((int(event["seq_len"]), kind), event["seconds"])
    # the population: the items every trial scored (a sweep's seeded items are doc ids spread over each task, the
    # same for every trial); the replay's blocks draw positions in each task's sorted ids
    first_key, first = next(iter(configs.items()))
    items = set(first["scores"].index)
    for key, config in configs.items():
        if set(config["scores"].index) != items:
            raise SystemExit(f"{path}: {key} was scored on other items than {first_key}; replay a grid whose trials "
                             "share their items")
    population = {task: tuple(sorted(i for t, i in items if t == task)) for task in sorted({t for t, _ in items})}
    tasks = {task: len(ids) for task, ids in population.items()}
    return {"configs": configs, "importance": importance, "item_s": statistics.median(per_item), "tasks": tasks,
            "population": population, "names": names}


def with_rates(data: dict, path: Path) -> dict:
    """The grid's data priced at the rates measured on one machine (the file's), instead of its trials' own."""
    rates = json.loads(path.read_text())
    importance = {pass_of(seq_len, None): float(seconds) for seq_len, seconds in rates["importance_s"].items()}
    missing = sorted({config["pass"] for config in data["configs"].values()} - set(importance))
    if missing:
        raise SystemExit(f"{path}: no importance_s for the passes (seq_len, statistics) {missing}")
    return {**data, "item_s": float(rates["item_s"]), "importance": importance}


def acc_mean(scores: pd.Series) -> float:
    return float(scores.groupby(level=0).mean().mean())


def band(configs: dict) -> tuple[tuple, set]:
    """The grid's best and every configuration the paired test on all items does not separate from it."""
    means = {key: acc_mean(c["scores"]) for key, c in configs.items()}
    best = max(means, key=lambda key: (means[key], str(key)))
    z = NormalDist().inv_cdf(0.975)
    tied = {key for key in configs
            if key == best or not paired_difference(configs[key]["scores"], configs[best]["scores"]).separated(z)}
    return best, tied


def regret(configs: dict, best: tuple, pick: list | None) -> float:
    """How much acc_mean on every item the pick gives up against the grid's best (a search with no pick: all of it).
    The band says whether a pick is distinguishable from the best; this says by how much it falls short."""
    return acc_mean(configs[best]["scores"]) - (0.0 if pick is None else acc_mean(configs[tuple(pick)]["scores"]))


class Replay:
    """One search's bookkeeping: the seconds it spent, and the configurations it scored on every item."""

    def __init__(self, data: dict, blocks: Blocks, cost: str):
        self.data, self.blocks, self.cost = data, blocks, cost
        self.seconds, self.passes, self.full = 0.0, set(), {}

    def prune(self, key: tuple) -> None:
        importance_pass = self.data["configs"][key]["pass"]
        if importance_pass not in self.passes:  # the sweep's importance cache: each pass once
            self.passes.add(importance_pass)
            self.seconds += self.data["importance"].get(importance_pass, 0.0)
        self.seconds += self.data["configs"][key]["prune_s"]

    def score(self, key: tuple, block: int, first: bool) -> pd.Series:
        """The configuration's scores on the items after `block`, paying for the pass (`first`: the trial's first)."""
        items = self.blocks.items(block)
        paid = self.blocks.new_items(block) if self.cost == "added" and not first else items
        self.seconds += sum(map(len, paid.values())) * self.data["item_s"]
        ids = self.data["population"]
        index = pd.MultiIndex.from_tuples([(t, ids[t][p]) for t, positions in items.items() for p in positions],
                                          names=["task", "doc_id"])
        scores = self.data["configs"][key]["scores"].loc[index]
        if block == self.blocks.count - 1:
            self.full[key] = acc_mean(scores)
        return scores

    def pick(self) -> tuple | None:
        return max(self.full, key=lambda key: (self.full[key], str(key))) if self.full else None


def searcher_of(names: tuple[str, ...], keys: list[tuple], seed: int, budget: int) -> PerModelSearcher:
    domains = {name: sorted({k[i] for k in keys}, key=str) for i, name in enumerate(names)}
    return PerModelSearcher(["model"], domains, budget, {}, metric="acc_mean", mode="max", seed=seed,
                            n_startup_trials=min(10, budget))


def proposals(search: str, names: tuple[str, ...], keys: list[tuple], rng, seed: int, budget: int):
    """The configurations a search tries, in its order; TPE's are proposed one at a time, told each result."""
    if search.startswith("tpe"):
        searcher = searcher_of(names, keys, seed, budget)
        for n in range(budget):
            config = searcher.suggest(str(n))
            if not isinstance(config, dict):
                return
            told = yield tuple(config[name] for name in names)
            searcher.on_trial_complete(str(n), {"acc_mean": told})
        return
    order = [keys[i] for i in rng.permutation(len(keys))]
    for key in order[:budget] if search == "random" else order:  # noqa: UP028 (send() reaches a generator only)
        yield key


def run(search: str, data: dict, sizes: tuple[int, ...], seed: int, args) -> dict:
    configs = data["configs"]
    keys = sorted(configs, key=str)
    tasks = data["tasks"]
    blocks = Blocks.plan(tasks, (*sizes, max(tasks.values())), race_seed(seed, "replay"))
    replay, rng = Replay(data, blocks, args.cost), np.random.default_rng(seed)
    race = Race(alpha=args.alpha) if search.endswith("race") else None
    asha = FidelityASHA(blocks.count, reduction_factor=args.reduction_factor, metric="acc_mean", mode="max") \
        if search.endswith("asha") else None
    tried, stopped, told, reached = proposals(search, data["names"], keys, rng, seed, args.budget), 0, None, []
    while True:
        try:
            key = tried.send(told)  # TPE is told the last pass's acc_mean, as Tune tells it a stopped trial's
        except StopIteration:
            break
        replay.prune(key)
        trial = SimpleNamespace(trial_id=str(key))
        if asha:
            asha.on_trial_add(None, trial)
        for block in range(blocks.count) if (race or asha) else [blocks.count - 1]:
            scores = replay.score(key, block, first=block == 0 or not (race or asha))
            told = acc_mean(scores)
            if race:
                goes_on = race.record(str(key), block, scores).go_on
            elif asha:
                goes_on = asha.on_trial_result(None, trial, {"acc_mean": told, PASS: block}) != "STOP"
            else:
                goes_on = True
            if block < blocks.count - 1 and not goes_on:
                stopped += 1
                break
        reached.append(block)
        if asha:
            asha.on_trial_complete(None, trial, {"acc_mean": told, PASS: block})
    pick = replay.pick()
    return {"pick": None if pick is None else list(pick), "seconds": replay.seconds, "stopped": stopped,
            "trials": len(reached), "reached": reached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", type=Path)
    parser.add_argument("--blocks", default="25,75", help="items per task after each cheap block (the last: all)")
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--budget", type=int, default=12, help="random, tpe_asha, tpe_race: trials per search")
    parser.add_argument("--reduction-factor", type=float, default=3)
    parser.add_argument("--cost", choices=("added", "rescored"), default="added")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--searches", default=",".join(SEARCHES))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rates", type=Path, help="price with these per-item and importance seconds (JSON)")
    parser.add_argument("--only", action="append", default=[], metavar="DIMENSION=V1,V2",
                        help="replay only the trials with these values of a searched dimension; repeatable")
    args = parser.parse_args()
    only, names = {}, grid_dimensions(args.grid)
    for item in args.only:
        name, _, values = item.partition("=")
        if name not in names or not values:
            parser.error(f"--only {item!r}: give one of {', '.join(names)}, '=' and its values, comma-separated")
        only[name] = set(values.split(","))
    data = load_grid(args.grid, only)
    if args.rates:
        data = with_rates(data, args.rates)
    best, tied = band(data["configs"])
    sizes = tuple(int(s) for s in args.blocks.split(","))
    grid_s = run("grid", data, sizes, 0, args)["seconds"]
    print(f"{args.grid}: {len(data['configs'])} configurations, {len(next(iter(data['configs'].values()))['scores'])}"
          f" items each, {data['item_s'] * 1000:.1f} ms per item; best {best}, {len(tied)} in its paired band; grid "
          f"{grid_s:.0f} s; blocks {sizes} + all, alpha {args.alpha}, budget {args.budget}, cost {args.cost}")
    out = {"grid": str(args.grid), "best": list(best), "band": sorted(map(list, tied)), "grid_s": grid_s,
           "settings": {k: str(v) for k, v in vars(args).items()}, "searches": {}}
    for search in args.searches.split(","):
        runs = [run(search, data, sizes, seed, args) for seed in range(args.seeds)]
        inside = sum(r["pick"] is not None and tuple(r["pick"]) in tied for r in runs)
        ratios = [r["seconds"] / grid_s for r in runs]
        regrets = [regret(data["configs"], best, r["pick"]) for r in runs]
        out["searches"][search] = {"runs": runs, "in_band": inside, "cost_ratio_median": statistics.median(ratios),
                                   "cost_ratio_max": max(ratios), "regret_median": statistics.median(regrets),
                                   "regret_max": max(regrets)}
        print(f"  {search:9s} pick in the band {inside}/{args.seeds}; cost / grid: median "
              f"{statistics.median(ratios):.3f} (max {max(ratios):.3f}); regret: median "
              f"{statistics.median(regrets):.4f} (max {max(regrets):.4f}); trials stopped early: median "
              f"{statistics.median(r['stopped'] for r in runs)}")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
