"""Regenerate the offline world in taylor_tune/data/world/: corpus, held-out text, mini tasks, tokenizer, models.

    .venv/bin/python scripts/make_offline_world.py              # everything (~7 min of CPU training in all)
    .venv/bin/python scripts/make_offline_world.py --data-only  # text and tasks only (seconds)
    .venv/bin/python scripts/make_offline_world.py --models tiny-qwen3  # one model (the text is rewritten, the same)

The text and task files are byte-identical for the same code (seeded); the tokenizer is deterministic; the
models are trained for a fixed number of steps from fixed seeds (bitwise identical on the same machine and
torch build, close elsewhere).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.world.generate import write_world_data  # noqa: E402
from scripts.world.train import train_causal_lm, train_tokenizer  # noqa: E402
from taylor_tune.sources.families import FAMILIES  # noqa: E402
from taylor_tune.sources.world import world_dir  # noqa: E402

ARCHITECTURES = {family.tiny_name: model_type for model_type, family in FAMILIES.items()}  # seeded by world_seed
# the sweep of every dense family (`taylor-tune sweep experiments/families.yaml`): its `models` line is written here
FAMILIES_EXPERIMENT = Path(__file__).resolve().parent.parent / "experiments" / "families.yaml"
DEFAULT_STEPS = 600
# Granite-MoE with the tiny multipliers learns slower: at 600 steps its loss was 0.634 and it beat chance on 4 of the
# seven tasks (tests/evaluation/test_evaluation.py asks 5); at 1,200, 0.456
STEPS = {"tiny-granitemoe": 1200}
# Small enough that pruning visibly costs accuracy; Llama-3-style GQA (4 query heads per key/value head).
SHAPE = dict(hidden_size=96, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=12, max_position_embeddings=512, rms_norm_eps=1e-5)

# As the released Gemmas: tied embeddings, attention scaled by the head size, Gemma 2's caps at 50 and 30 (the random
# tiny model's cap of 3 on the logits keeps a model from ever being sure: it trained to a loss of 1.19, the others ~0.5)
TRAINED_TRAITS = {
    "tiny-gemma2": dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=12,
                        tie_word_embeddings=True),
    "tiny-gemma3": dict(query_pre_attn_scalar=12, tie_word_embeddings=True),
    "tiny-phi3": dict(partial_rotary_factor=0.5),  # a rotated width the world's head size (12) halves evenly
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=world_dir())
    parser.add_argument("--data-only", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help=f"training steps of each model (default: {STEPS}, "
                        f"else {DEFAULT_STEPS})")
    parser.add_argument("--models", nargs="+", choices=sorted(ARCHITECTURES), default=sorted(ARCHITECTURES),
                        help="train only these (the others' folders are left as they are)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    write_world_data(args.out)
    print(f"wrote text and tasks to {args.out}")
    if args.data_only:
        return
    text = (args.out / "corpus.txt").read_text()
    tokenizer = train_tokenizer(text)
    tokenizer.save_pretrained(args.out / "tokenizer")
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    print(f"tokenizer: {len(tokenizer)} tokens; corpus: {ids.numel()} tokens")

    from transformers import AutoConfig, AutoModelForCausalLM

    for name, arch in ARCHITECTURES.items():
        if name not in args.models:
            continue
        seed = FAMILIES[arch].world_seed
        # each family's traits as its tiny random model has them (sources.families), on the world's shape, and
        # where the random one's values are chosen only to show in a test, the released models' (TRAINED_TRAITS)
        extra = {"sliding_window": None} if arch == "mistral" else dict(FAMILIES[arch].tiny)
        fields = {"tie_word_embeddings": False, **SHAPE, **extra, **TRAINED_TRAITS.get(name, {})}
        config = AutoConfig.for_model(
            arch, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, **fields,
        )
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        steps = args.steps or STEPS.get(name, DEFAULT_STEPS)
        print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, training {steps} steps", flush=True)
        start = time.perf_counter()
        mixture = FAMILIES[arch].experts is not None
        # a mixture trains with its router's load-balancing loss, as the released ones do, so that no expert is left
        # unused; off again before saving, or every loss the pruning computes would carry it
        model.config.output_router_logits = mixture
        losses = train_causal_lm(model, ids, steps=steps, seed=seed)
        model.config.output_router_logits = False
        print(f"{name}: final loss {sum(losses[-20:]) / 20:.3f} after {time.perf_counter() - start:.0f}s", flush=True)
        target = args.out / "models" / name
        shutil.rmtree(target, ignore_errors=True)
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
    if args.out.resolve() == world_dir().resolve():  # the shipped world: its experiment of every family follows it
        list_dense_families(FAMILIES_EXPERIMENT)


def list_dense_families(experiment: Path) -> None:
    """Rewrite the experiment's `models` line as every dense family's trained tiny model, in the families' order, so
    that a new family's module and its model are all the sweep of every family needs (the rest of the file is kept
    as written)."""
    models = ", ".join(family.tiny_name for family in FAMILIES.values() if family.experts is None)
    text, count = re.subn(r"^models: \[[^\]]*\]$", f"models: [{models}]", experiment.read_text(), flags=re.M)
    if count != 1:
        raise SystemExit(f"{experiment}: no one `models: [...]` line to rewrite")
    experiment.write_text(text)


if __name__ == "__main__":
    main()
