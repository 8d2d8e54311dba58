"""Issue 94, must-show 3: a family is its declaration. A throwaway family, Llama under another model type
(`renamedllama`, registered with transformers as a new release's type would be), is added to a copy of the
repository as one module of `sources/families/` and nothing else; the world script makes its tiny model
(scripts/make_offline_world.py --models tiny-renamedllama); then every arch-wide test of the copy runs for it: each
test parametrized by a family's tiny model (tests.helpers.ARCHS, the trained dense models), selected by its id, and
each is one that Llama has too, and the check that the sweep of every family (experiments/families.yaml, whose
models the world script writes) names it. Every one passes: the registries, the pruned class, the GGUF writer, the
methods and the streamed passes all read the declaration.

The world script trains it 2 steps, not its 600: the family is Llama by construction, so the world's trained Llama
is a trained model of it, and its weights are put in the folder the script wrote (whose configuration, tokenizer and
shapes are checked to be that Llama's but for the type). Training a Llama a second time was most of the test's time
(BENCHMARKS.md, make-test-94c) and would show nothing the trained Llama does not."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.sweep_helpers import REPO

pytestmark = pytest.mark.slow  # a copy of the repository, the world script, a pytest run over it

FAMILY = '''"""A throwaway family for tests/sources/test_new_family.py: Llama under another model type, registered with
transformers as a new release's type would be."""

import transformers
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from taylor_tune.sources.families.base import Family


class RenamedLlamaConfig(LlamaConfig):
    model_type = "renamedllama"


class RenamedLlamaForCausalLM(LlamaForCausalLM):
    config_class = RenamedLlamaConfig


AutoConfig.register("renamedllama", RenamedLlamaConfig)
AutoModelForCausalLM.register(RenamedLlamaConfig, RenamedLlamaForCausalLM)
transformers.RenamedLlamaForCausalLM = RenamedLlamaForCausalLM  # where a release's class is found by its name

FAMILY = Family("renamedllama", world_seed=13, gguf="llama", all_biases=True, gguf_rope_scalings=("default", "llama3"))
'''


# the check that the experiment of every family names each family's trained model: not parametrized by a family
EVERY_FAMILY = "test_the_families_experiment_names_a_trained_model_of_every_family"


def copy_repo(into: Path) -> Path:
    """The repository's tracked and untracked-but-not-ignored files, as they are in the working tree."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, into / name)
    return into


def run(root: Path, *args: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


def but_the_type(config: Path) -> dict:
    """A model's configuration without what names its family and the transformers release that wrote it (and
    `output_router_logits`, which the world script now writes off on every model it trains: the world's Llama was
    trained before it did)."""
    data = json.loads(config.read_text())
    return {k: v for k, v in data.items()
            if k not in ("model_type", "architectures", "transformers_version", "output_router_logits")}


def shapes(folder: Path) -> dict:
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as weights:
        return {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}


def of_family(ids: set[str], name: str) -> set[str]:
    """The ids parametrized by one of `name`'s tiny models (its random one or its trained one)."""
    return {i for i in ids if "[" in i and re.search(rf"\btiny-{name}(-random)?\b", i.split("[", 1)[1])}


def test_a_new_family_is_one_module_and_passes_every_arch_wide_test(tmp_path):
    root = copy_repo(tmp_path / "repo")
    (root / "taylor_tune" / "sources" / "families" / "renamedllama.py").write_text(FAMILY)
    world = run(root, "scripts/make_offline_world.py", "--models", "tiny-renamedllama", "--steps", "2")
    assert world.returncode == 0, world.stdout[-3000:] + world.stderr[-3000:]
    models = root / "taylor_tune" / "data" / "world" / "models"
    ours, llama = models / "tiny-renamedllama", models / "tiny-llama"
    assert "tiny-renamedllama: final loss" in world.stdout  # trained by the script's own loop, not only written
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in llama.iterdir())
    assert but_the_type(ours / "config.json") == but_the_type(llama / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (ours / name).read_bytes() == (llama / name).read_bytes(), name
    assert shapes(ours) == shapes(llama)
    shutil.copy2(llama / "model.safetensors", ours / "model.safetensors")  # the trained Llama (above)
    # and the sweep of every family lists it (the world script writes that experiment's models)
    assert "tiny-renamedllama" in yaml.safe_load((root / "experiments" / "families.yaml").read_text())["models"]

    listing = run(root, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "not gpu", "tests",
                  timeout=600)
    assert listing.returncode == 0, listing.stdout[-3000:] + listing.stderr[-3000:]
    ids = {line for line in listing.stdout.splitlines() if "::" in line}
    ours, llamas = of_family(ids, "renamedllama"), of_family(ids, "llama")
    assert len(ours) >= 30, sorted(ours)  # 36 when written: an empty selection would pass vacuously
    assert {i.replace("renamedllama", "llama") for i in ours} <= llamas  # each one Llama has too

    proc = run(root, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", "tests", "-k",
               f"renamedllama or {EVERY_FAMILY}", "--timeout", "1500")
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed == len(ours) + 1 and "failed" not in summary and "error" not in summary, summary
