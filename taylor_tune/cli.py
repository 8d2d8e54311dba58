"""The `taylor-tune` command: argv -> library calls. The only module that reads argv or sets up logging.

User errors (bad config, missing files, impossible plans) print one line and exit 2; no traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from taylor_tune.errors import TaylorTuneError

PRUNE_EXAMPLE = """\
example (a tiny model on the shipped sample text, CPU, a few seconds):
  taylor-tune prune --model tiny-llama --method taylor --sparsity 0.2 --seq-len 64 \\
      --num-samples 128 --calibration sample --seed 0 --output runs/tiny-llama

example (LLaMA-3-8B on one GPU, WikiText-2 calibration):
  taylor-tune prune --model meta-llama/Meta-Llama-3-8B --method blockwise --sparsity 0.2 \\
      --seq-len 64 --num-samples 128 --calibration wikitext2 --device cuda --dtype bfloat16 --output runs/llama3-8b

writes OUTPUT/pruning_summary.json, OUTPUT/importance.safetensors and OUTPUT/model/
"""


def _add_prune(subparsers) -> None:
    from taylor_tune.config import PruneConfig

    fields = PruneConfig.model_fields
    p = subparsers.add_parser(
        "prune", help="prune one model with one configuration",
        description="Prune a causal LM with group-normalized Taylor importance (or a baseline) and save it.",
        epilog=PRUNE_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="a YAML file of prune settings (keys as the options below); options given here override it")
    p.add_argument("--model", help=fields["model"].description)
    p.add_argument("--output", required=True, help="folder for the summary, the importance and the pruned model")
    for name in ("method", "sparsity", "seq_len", "num_samples", "calibration", "seed", "micro_batch_size",
                 "device", "dtype", "layerwise_max_ratio", "blockwise_layer_start", "blockwise_layer_end",
                 "extreme_ratio_threshold"):
        # Values stay strings here: pydantic converts and validates them, naming the field on error.
        p.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                       help=f"{fields[name].description} (default: {fields[name].default})")
    p.add_argument("--trust-remote-code", action="store_true", default=None, help=fields["trust_remote_code"].description)
    p.set_defaults(handler=_run_prune)


def _run_prune(args: argparse.Namespace) -> int:
    from taylor_tune.config import PruneConfig, build_prune_config, read_config_file

    values = read_config_file(args.config) if args.config else {}
    values |= {k: v for k, v in vars(args).items() if k in PruneConfig.model_fields and v is not None}
    config = build_prune_config(values)  # before torch is even imported

    from taylor_tune.artifacts import write_prune_artifacts
    from taylor_tune.prune import prune

    result = prune(config)
    out = write_prune_artifacts(args.output, config, result)
    d = result.diagnostics
    print(
        f"{config.method}: removed {d['params_count_before'] - d['params_count']} of {d['params_count_before']} "
        f"parameters (pruning_ratio {d['pruning_ratio']:.4f}, target {config.sparsity}); "
        f"extreme layers {d['extreme_pruning_layers']}; wrote {out}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="taylor-tune", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_prune(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except TaylorTuneError as error:
        print(f"taylor-tune: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("taylor-tune: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
