"""Does the fast test tier catch realistic bugs? Plant each mutation of a curated list in a copy of the repository and
run the fast tier (`-m "not slow and not real and not gpu"`) against it; print the survivors and the kill rate.

Each mutation is a small, plausible mistake in the core (importance, groups, methods, plan, apply, scorer,
calibration, statistics, the importance cache, diagnostics): the kind a refactor or a hurried fix introduces. A
mutation is text replaced in one file; the copy is a fresh temporary folder per mutation, so the working tree is
never edited. The unmutated copy runs first and must pass.

    .venv/bin/python scripts/mutants.py                     # all of them, two at a time (make mutants)
    .venv/bin/python scripts/mutants.py --only apply-bias   # one, by name
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAST = "not slow and not real and not gpu"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    edits: tuple[tuple[str, str], ...]  # (original text, replacement); each original occurs exactly once
    what: str


def m(name: str, path: str, what: str, *edits: tuple[str, str]) -> Mutant:
    return Mutant(name, f"taylor_tune/{path}", edits, what)


MUTANTS = (
    # importance
    m("importance-attn-size", "pruning/importance.py", "attention scores divided by the MLP channel size",
      ("(a / layout.attn_group_params)", "(a / layout.mlp_channel_params)")),
    m("importance-signed", "pruning/importance.py", "salience w*g summed with its sign, not |w*g|",
      (".abs_().div_(n)", ".div_(n)")),
    m("importance-micro-batch-mean", "pruning/importance.py", "each micro-batch's mean loss, not the sum over samples",
      ("(loss * batch.shape[0]).backward()", "loss.backward()")),
    m("importance-taylor-sum-size", "pruning/importance.py", "taylor_sum scales attention by the MLP channel size",
      ("tuple(a * layout.attn_group_params for a", "tuple(a * layout.mlp_channel_params for a")),
    m("importance-l1-ignored", "pruning/importance.py", "magnitude scores always squared (criterion l1 ignored)",
      ("w.float().abs().pow(p)", "w.float().abs().pow(2)")),
    m("importance-grad-mean-unscaled", "pruning/importance.py", "gradient mean not divided by the sample count",
      ("/ n / count\n", "/ count\n")),
    # groups
    m("groups-attn-bias-left-out", "pruning/groups.py", "q/k/v biases left out of the prunable parameters",
      ('params.append((f"self_attn.{name}.bias", proj.bias))', "pass")),
    m("groups-o-proj-grouping", "pruning/groups.py", "o_proj's columns grouped row-major",
      ("a += v.reshape(v.shape[0], groups, rep * d).sum(dim=(0, 2))", "a += v.reshape(groups, -1).sum(dim=1)")),
    m("groups-q-interleaved", "pruning/groups.py", "query rows grouped as if heads were interleaved",
      ("a += v.reshape(groups, rep * d, -1).sum(dim=(1, 2))", "a += v.reshape(rep * d, groups, -1).sum(dim=(0, 2))")),
    m("groups-mlp-channel-size", "pruning/groups.py", "an MLP channel counted as two rows, not three",
      ("mlp_channel_params = 3 * hidden + mlp_bias", "mlp_channel_params = 2 * hidden + mlp_bias")),
    # plan and methods
    m("plan-empties-block", "pruning/methods/_base.py", "the global ranking may remove a block's last group",
      ("if left[kind][layer] == 1:", "if left[kind][layer] == 0:")),
    m("plan-ranking-reversed", "pruning/plan.py", "groups ranked most important first",
      ("    items.sort()\n", "    items.sort(reverse=True)\n")),
    m("plan-target-layers-only", "pruning/plan.py", "the budget a fraction of the decoder layers, not the whole model",
      ("return sparsity * layout.total_params", "return sparsity * sum(layout.layer_params)")),
    m("plan-validate-allows-empty", "pruning/plan.py", "validation lets a plan empty a block",
      ("if len(removed) >= size:", "if len(removed) > size:")),
    m("layerwise-inverted", "pruning/methods/layerwise.py", "important layers lose more, not less",
      ("mean / importance", "importance / mean")),
    m("blockwise-first-layer", "pruning/methods/blockwise.py", "blockwise prunes the first layer by default",
      ("start = 1 if options.blockwise_layer_start is None", "start = 0 if options.blockwise_layer_start is None")),
    m("blockwise-ratio-per-block", "pruning/methods/blockwise.py", "closest_ratio compares with one block's channels",
      ("abs(kc[0] / g - kc[1] / (n * c))", "abs(kc[0] / g - kc[1] / c)")),
    m("blockwise-highest-channels", "pruning/methods/blockwise.py", "blockwise removes the highest-scored channels",
      ('mlp[layer] = set(scores.mlp[layer].argsort(kind="stable")[:mlp_here]',
       'mlp[layer] = set((-scores.mlp[layer]).argsort(kind="stable")[:mlp_here]')),
    m("random-unseeded", "pruning/methods/random.py", "the random baseline ignores its seed",
      ("np.random.default_rng(seed)", "np.random.default_rng()")),
    # apply
    m("align-by-position", "pruning/aligned.py", "a width rounded by channel index, not by the layer's ranking",
      ('order = scores.mlp[layer].argsort(kind="stable")', "order = np.arange(channels)")),
    m("apply-bias", "pruning/apply.py", "a sliced projection keeps the first bias entries, not the kept rows",
      ("b.index_select(0, keep.to(b.device)) if dim == 0 else b", "b[:out_features] if dim == 0 else b")),
    m("apply-q-rows", "pruning/groups.py", "a kept group's rows start at its index, not at index x its width",
      ("(groups[:, None] * width + torch.arange(", "(groups[:, None] + torch.arange(")),
    m("apply-down-proj-rows", "pruning/apply.py", "down_proj sliced along its output rows",
      ("mlp.down_proj = _slice_linear(mlp.down_proj, keep_channels, 1)",
       "mlp.down_proj = _slice_linear(mlp.down_proj, keep_channels, 0)")),
    # the servable layout (issue 83)
    m("servable-layerwise-counts-attention", "pruning/methods/layerwise.py",
      "the servable layerwise counts the kept attention's scores towards each layer's importance",
      ("layer_importance(scores, layout, options.attention)", "layer_importance(scores, layout)")),
    m("servable-ranks-attention", "pruning/methods/_base.py", "the servable global ranking still holds attention",
      ("ranked_groups(scores, kinds=kinds(options))", "ranked_groups(scores)")),
    # answer keys (issue 84's planted slips)
    m("answers-norm-by-tokens", "evaluation/answers.py",
      "acc_norm divides the log-likelihoods by each choice's tokens, not its characters",
      ("lengths[position, self.idx] = self.chars",
       "lengths[position, self.idx] = [len(c) for c in self.continuations]")),
    m("answers-choices-reversed", "evaluation/answers.py", "the gold choice found counting the choices from the end",
      ("rows.append((reported, instance.idx, instance.idx == gold,",
       "rows.append((reported, instance.idx, len(choices) - 1 - instance.idx == gold,")),
    # scorer
    m("scorer-sees-earlier-continuations", "evaluation/scorer.py",
      "a packed continuation attends to the earlier continuations of its pack",
      ("(seen == prefix_of[:, :, None])", "(seen >= prefix_of[:, :, None])")),
    m("scorer-positions-run-on", "evaluation/scorer.py",
      "a continuation's positions continue after the previous continuation, not after the prefix",
      ("positions[row, column : column + n] = np.arange(p, p + n)",
       "positions[row, column : column + n] = np.arange(column - start, column - start + n)")),
    m("scorer-rows-off-by-one", "evaluation/scorer.py",
      "a continuation's first token scored from its own first position, not the prefix's last",
      ("at_column.append(np.concatenate(([start + p - 1], np.arange(column, column + n))))",
       "at_column.append(np.concatenate(([column], np.arange(column, column + n))))")),
    # calibration
    m("calibration-not-nested", "sources/calibration.py", "the document order depends on the sample count",
      ("np.random.default_rng(seed).permutation", "np.random.default_rng(seed + num_samples).permutation")),
    m("calibration-no-separator", "sources/calibration.py", "documents concatenated without their separator",
      ("                stream += separator\n", "                pass\n")),
    # statistics
    m("stats-lead-one-se", "reporting/stats.py", "a lead compared with 1 standard error instead of z = 1.96",
      ("bool(lead.difference > z * lead.stderr)", "bool(lead.difference > lead.stderr)"),
      ("independent_tie = gap <= z * gap_se", "independent_tie = gap <= gap_se")),
    m("stats-acc-mean-se", "reporting/stats.py", "acc_mean's stderr divided by sqrt(tasks), not by tasks",
      ("/ len(columns)", "/ math.sqrt(len(columns))")),
    m("layout-servable-read-as-aligned", "reporting/stats.py",
      "a servable trial with a larger multiple of 256 named by its align, not as servable",
      ("    if _set(servable):\n        return \"servable\"\n    if align is not None",
       "    if align is not None")),
    # the Pareto front
    m("pareto-weak-dominance", "reporting/pareto.py", "a point equal in every objective counted as dominating",
      ("strictly = (better[:, None, :] > better[None, :, :]).any(axis=2)",
       "strictly = (better[:, None, :] >= better[None, :, :]).any(axis=2)")),
    m("pareto-mode-ignored", "reporting/pareto.py", "every objective maximized, a perplexity too",
      ("better = np.where([o.ascending for o in objectives], -values, values)  # higher",
       "better = values  # higher")),
    # racing
    m("racing-direction", "sweep/racing.py", "a trial raced out for being better than the incumbent, not worse",
      ("worse = found.difference < 0 and found.separated(self.z)",
       "worse = found.difference > 0 and found.separated(self.z)")),
    m("racing-unpaired", "sweep/racing.py", "the incumbent's items shuffled within each task: compared as unpaired",
      ("theirs = theirs.loc[mine.index]",
       "theirs = theirs.loc[mine.index].groupby(level=0, group_keys=False).apply(\n"
       "            lambda s: s.sample(frac=1, random_state=0).set_axis(s.index))")),
    # the importance cache
    m("cache-key-without-seq-len", "pruning/scoring.py", "the importance-cache key ignores seq_len",
      ('"seq_len": config.seq_len,\n', "")),
    m("cache-key-config-dtype", "pruning/scoring.py",
      "the importance-cache key holds the config's dtype, not the model's",
      ('"dtype": str(dtype).removeprefix("torch."),', '"dtype": config.dtype,')),
    # diagnostics
    m("diagnostics-threshold-inclusive", "pruning/diagnostics.py", "a layer at the threshold counted as extreme",
      ("sum(r > extreme_threshold for r in layer_ratio)", "sum(r >= extreme_threshold for r in layer_ratio)")),
    m("diagnostics-ratio-inverted", "pruning/diagnostics.py", "the spread ratio computed as min/max",
      ("ratio = high / low", "ratio = low / high")),
    # issue 91: slips every tier let through before
    m("calibration-loss-all-tokens", "pruning/measured.py",
      "the calibration loss divided by every token of the batch, not by the predicted ones",
      ("tokens += batch[:, 1:].numel()", "tokens += batch.numel()")),
    m("fidelity-zero-accepted", "config.py", "an evaluation fidelity of 0 accepted",
      ("if any(v is not None and v <= 0 for v in value):", "if any(v is not None and v < 0 for v in value):")),
    m("rebuild-first-ppl-pass", "export/rebuild.py", "the export's rebuild checked against the first perplexity pass",
      ('passes[-1]["ppl"])', 'passes[0]["ppl"])')),
    m("export-last-constraint-only", "export/choose.py", "only the last of several export --constraint applied",
      ("candidates = candidates[constraint.holds(candidates[constraint.metric]).to_numpy()]",
       "candidates = valid[constraint.holds(valid[constraint.metric]).to_numpy()]")),
    m("gguf-k-permuted-by-query-heads", "export/to_gguf.py", "the GGUF's k rows permuted with the query-head count",
      ('("k_proj", "attn_k", shape["kv_heads"])', '("k_proj", "attn_k", shape["heads"])')),
    # issue 92: the layer-major gradient pass
    m("streamed-input-of-another-batch", "pruning/streamed.py", "a layer's kept input taken from the previous batch",
      ("x = kept.get((index, part)).to(stream.device).requires_grad_(index > 0)",
       "x = kept.get((index, max(part - 1, 0))).to(stream.device).requires_grad_(index > 0)")),
    m("streamed-snapshot-before-its-last-batch", "pruning/streamed.py",
      "a snapshot taken before its last micro-batch is accumulated",
      ("                for _, p in params:\n                    buffers[p].add_(p.grad)\n",
       "                if end in taken:\n"
       "                    taken[end].append(layer_snapshot(layer, params, buffers, end))\n"
       "                for _, p in params:\n                    buffers[p].add_(p.grad)\n"),
      ("                kept.drop((index, part))  # this layer's part is done with\n"
       "                if end in taken:\n"
       "                    taken[end].append(layer_snapshot(layer, params, buffers, end))\n",
       "                kept.drop((index, part))  # this layer's part is done with\n")),
    m("streaming-forward-of-another-call", "sources/streaming.py",
      "the layer-major forward takes a call's input from the previous call",
      ("x = kept.get((index, part)).to(stream.device)\n",
       "x = kept.get((index, max(part - 1, 0))).to(stream.device)\n")),
    m("streaming-head-before-norm", "sources/streaming.py", "the head's kept positions taken without the final norm",
      ("logits = model.lm_head(normed if keep is None else normed[keep])",
       "logits = model.lm_head(normed if keep is None else hidden[keep])")),
    m("streamed-activation-snapshot-a-batch-early", "pruning/activations.py",
      "a streamed activation snapshot taken at the start of its last micro-batch, not its end",
      ("if parts[part][1] in taken:\n                taken[parts[part][1]]",
       "if parts[part][0] in taken:\n                taken[parts[part][0]]")),
    m("streamed-similarity-input-for-output", "pruning/similarity.py",
      "the streamed similarity reads the layer's input as its output",
      ("yield lambda part, x, y: record(index, x, y)", "yield lambda part, x, y: record(index, x, x)")),
    m("streamed-measured-loss-unmasked", "pruning/measured.py",
      "a streamed candidate plan's loss measured on the unmasked layers",
      ("        _mask_layer(layer, self.plan.attn_removed[index], self.plan.mlp_removed[index], "
       "sliced_norms(self.model))\n", "")),
    m("streamed-apply-layer-renumbered-wrong", "pruning/apply.py",
      "a streamed pruned layer written under its old index after layers are removed",
      ('prefix = f"model.layers.{number - 1}."', 'prefix = f"model.layers.{index}."')),
    # issue 93: the experts method
    m("experts-router-row-kept", "pruning/experts.py", "a removed expert's router row kept",
      ("router.weight = nn.Parameter(router.weight.detach().index_select(0, keep), router.weight.requires_grad)",
       "router.weight = nn.Parameter(router.weight.detach(), router.weight.requires_grad)")),
    m("experts-indices-shifted-by-one", "pruning/experts.py", "the kept experts' indices shifted by one on removal",
      ("keep = kept(len(router.weight), removed[layer]).to(router.weight.device)",
       "keep = ((kept(len(router.weight), removed[layer]) + 1) % len(router.weight)).to(router.weight.device)")),
    m("experts-reap-over-all-tokens", "pruning/experts.py",
      "REAP averaged over every calibration token, not the tokens routed to the expert",
      ('"reap": self.gated_norm[layer] / routed', '"reap": self.gated_norm[layer] / max(self.tokens, 1)')),
    m("gguf-experts-gate-up-swapped", "export/to_gguf.py", "a mixture's expert gate and up halves written swapped",
      ('yield f"{block}.ffn_gate_exps.weight", experts.gate_up_proj[:, :width]',
       'yield f"{block}.ffn_gate_exps.weight", experts.gate_up_proj[:, width:]'),
      ('yield f"{block}.ffn_up_exps.weight", experts.gate_up_proj[:, width:]',
       'yield f"{block}.ffn_up_exps.weight", experts.gate_up_proj[:, :width]')),
    m("gguf-renormalisation-lost", "export/to_gguf.py",
      "the model's top-k renormalisation lost: taken to be what llama.cpp's graph computes",
      ("renormalised = field if isinstance(field, bool) else bool(getattr(config, field))",
       "renormalised = moe.gguf_renormalised")),
)


def copy_repo(into: Path) -> Path:
    """The repository's tracked and untracked-but-not-ignored files, as they are in the working tree."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


def apply(mutant: Mutant, root: Path) -> None:
    path = root / mutant.path
    text = path.read_text()
    for original, replacement in mutant.edits:
        if text.count(original) != 1:
            raise SystemExit(f"{mutant.name}: {original!r} occurs {text.count(original)} times in {mutant.path}")
        text = text.replace(original, replacement)
    path.write_text(text)
    compile(text, str(path), "exec")  # a mutation is a bug, not a syntax error


def run_fast_tier(root: Path, timeout: float) -> tuple[bool, str, float]:
    """(passed, the first failing test or the tail of the output, seconds)."""
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", FAST],
                              cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, "timed out", time.perf_counter() - start
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in proc.stdout.splitlines() if line.startswith("FAILED ")]
    summary = failed[0] if failed else (proc.stdout.strip().splitlines() or ["no output"])[-1]
    return proc.returncode == 0, summary, time.perf_counter() - start


def check(mutant: Mutant | None, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        root = copy_repo(Path(tmp))
        if mutant is not None:
            apply(mutant, root)
        passed, summary, seconds = run_fast_tier(root, timeout)
    return {"name": mutant.name if mutant else "none", "killed": not passed, "by": None if passed else summary,
            "seconds": round(seconds, 1), **({"file": mutant.path, "what": mutant.what} if mutant else {})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only")
    parser.add_argument("--jobs", type=int, default=2, help="mutations run at once (default 2: this machine's cores)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run of the fast tier")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    names = {m.name for m in MUTANTS}
    unknown = sorted(set(args.only or ()) - names)
    if unknown:
        print(f"mutants: unknown mutation {unknown[0]!r}; known: {', '.join(sorted(names))}", file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]

    baseline = check(None, args.timeout)
    if baseline["killed"]:
        print(f"mutants: the fast tier fails without any mutation ({baseline['by']}); fix that first", file=sys.stderr)
        return 1
    print(f"unmutated: the fast tier passes ({baseline['seconds']:.0f} s)")
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = []
        for result in pool.map(lambda mutant: check(mutant, args.timeout), chosen):
            results.append(result)
            verdict = f"killed by {result['by']}" if result["killed"] else "SURVIVED"
            print(f"{result['name']:36s} {verdict} ({result['seconds']:.0f} s)", flush=True)
    killed = sum(r["killed"] for r in results)
    survivors = [r["name"] for r in results if not r["killed"]]
    print(f"killed {killed} of {len(results)} ({100 * killed / len(results):.0f}%)"
          + (f"; survivors: {', '.join(survivors)}" if survivors else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"baseline_s": baseline["seconds"], "killed": killed, "total": len(results),
                                         "results": results}, indent=2) + "\n")
    return 0 if not survivors else 1


if __name__ == "__main__":
    sys.exit(main())
