"""The README and docs/ cannot go stale: every Python snippet's imports resolve, every dotted `taylor_tune.` name and
file path they mention exists, every `taylor-tune` command and script they show takes the flags shown (checked
against the real parsers), every experiment file they show validates, and every link points at a file; every
pruning setting they name is a prune flag, docs/layout.md names every module in its package's paragraph, and the
README's chain of a trial's stages is `trial_stages`'s (issue 63, build 4). The README is
a front door: at most 250 lines."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# flags of other tools the pages show (Ray's CLI): not ours to check
OTHER_TOOLS = {"--address", "--working-dir", "--runtime-env-json", "--metrics-export-port", "--entrypoint-num-gpus",
               "--head", "--dashboard-host", "--model_args", "--model", "--tasks", "--no-wait", "--submission-id",
               "--follow", "--dashboard-agent-listen-port"}
FENCE = re.compile(r"^```([a-z]*)\n(.*?)^```", re.S | re.M)


def blocks(text: str, *languages: str) -> list[str]:
    return [body for language, body in FENCE.findall(text) if language in languages]


def prose(text: str) -> str:
    return FENCE.sub("", text)


def subparsers() -> dict[str, argparse.ArgumentParser]:
    from taylor_tune.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def script_flags(path: Path) -> set[str]:
    """The options a script's argparse declares, read from its source (nothing is run)."""
    return {"--help"} | set(re.findall(r"""add_argument\(\s*["'](--[a-z0-9-]+)""", path.read_text()))


def commands(text: str) -> list[list[str]]:
    """Every shell command in the page's unlabelled or shell code blocks, and every inline `taylor-tune ...` or
    `<script>.py ...`."""
    found = []
    for body in blocks(text, "", "bash", "sh", "shell"):
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                try:
                    found.append(shlex.split(line))
                except ValueError:
                    continue
    for span in re.findall(r"`([^`]*(?:taylor-tune |\.py )[^`]*)`", prose(text)):
        try:
            found.append(shlex.split(span))
        except ValueError:
            continue
    return found


def command_problems(text: str) -> list[str]:
    parsers, problems = subparsers(), []
    for words in commands(text):
        for position, word in enumerate(words):
            if word.endswith("taylor-tune"):
                rest = [w for w in words[position + 1:] if w not in ("-v", "--verbose")]
                if not rest or rest[0] not in parsers:
                    problems.append(f"taylor-tune {' '.join(rest[:1])}: no such command")
                    break
                known = {s for a in parsers[rest[0]]._actions for s in a.option_strings}
                problems += [f"taylor-tune {rest[0]} {w}: no such option" for w in rest[1:]
                             if w.startswith("--") and w.split("=")[0] not in known]
                break
            if word.endswith(".py") and (ROOT / word).is_file() and word.split("/")[0] in ("bench", "scripts"):
                known = script_flags(ROOT / word)
                problems += [f"{word} {w}: no such option" for w in words[position + 1:]
                             if w.startswith("--") and w.split("=")[0] not in known]
                break
    return problems


def flag_problems(text: str) -> list[str]:
    """An inline `--flag` must be an option of a taylor-tune command, of a bench or scripts program, or another
    tool's listed above."""
    ours = {s for p in subparsers().values() for a in p._actions for s in a.option_strings}
    ours |= {f for folder in ("bench", "scripts") for path in (ROOT / folder).glob("*.py") for f in script_flags(path)}
    return [f"`{flag}`: no command takes it" for flag in re.findall(r"`(--[a-z][a-z0-9-]*)", prose(text))
            if flag not in ours | OTHER_TOOLS]


def import_problems(text: str) -> list[str]:
    problems = []
    for body in blocks(text, "python"):
        for node in ast.walk(ast.parse(body)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    problems += resolve(alias.name)
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    problems += resolve(node.module, alias.name)
    return problems


def resolve(module: str, name: str | None = None) -> list[str]:
    try:
        imported = importlib.import_module(module)
    except ImportError as error:
        return [f"import {module}: {error}"]
    if name is not None and not hasattr(imported, name):
        try:
            importlib.import_module(f"{module}.{name}")
        except ImportError:
            return [f"from {module} import {name}: no such name"]
    return []


def name_problems(text: str) -> list[str]:
    """Dotted `taylor_tune.x.y` names and repository paths in inline code exist."""
    problems = []
    for dotted in set(re.findall(r"`(taylor_tune(?:\.[A-Za-z_]\w*)+)", text)):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                value = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attribute in parts[cut:]:
                value = getattr(value, attribute, None)
            if value is None:
                problems.append(f"`{dotted}`: no such name")
            break
    for path in set(re.findall(r"`((?:taylor_tune|tests|bench|scripts|experiments|search_spaces|docs|dashboards|"
                               r"docker)/[\w./-]*\w)`", text)):
        if "<" not in path and "*" not in path and not (ROOT / path).exists():
            problems.append(f"`{path}`: no such file")
    return problems


def link_problems(page: Path, text: str) -> list[str]:
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
    return [f"link {link}: no such file" for link in links if not (page.parent / link).exists()]


def experiment_problems(text: str) -> list[str]:
    from taylor_tune.errors import ConfigError
    from taylor_tune.sweep.experiment import Experiment, _resolve_space

    problems = []
    for body in blocks(text, "yaml"):
        data = yaml.safe_load(body)
        if isinstance(data, dict) and "models" in data:
            try:
                Experiment(**_resolve_space(data, ROOT))
            except (ConfigError, ValueError) as error:
                problems.append(f"experiment {data.get('name')}: {error}")
    return problems


# the packages whose every module docs/layout.md names in the package's paragraph of its layout block
LAYOUT_PACKAGES = ("sources", "pruning", "recovery", "evaluation", "sweep", "reporting", "compat")


def layout_problems(text: str) -> list[str]:
    """Every module and subfolder of each LAYOUT_PACKAGES package (sweep/tune's and sweep/stages' in sweep's
    paragraph), and every root module, named as a word in the package's paragraph of the first layout block
    (`  name/  ...` and the lines indented under it)."""
    block = blocks(text, "")[0]
    paragraphs: dict[str, str] = {}
    current = "root"
    for line in block.splitlines():
        head = re.match(r"^  ([a-z_]+)/\s", line)
        current = head.group(1) if head else (current if line.startswith("    ") else "root")
        paragraphs[current] = paragraphs.get(current, "") + " " + line
    package_root = ROOT / "taylor_tune"
    problems = []
    for package in (*LAYOUT_PACKAGES, "root"):
        folder = package_root if package == "root" else package_root / package
        names = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
        names += [p.name + "/" for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()
                  and package != "root"]
        if package == "sweep":  # its subpackages' modules in its own paragraph
            names += [p.stem for sub in ("tune", "stages") for p in (folder / sub).glob("*.py") if p.stem != "__init__"]
        words = set(re.findall(r"[A-Za-z_]+/?", paragraphs.get(package, ""))) | set(
            re.findall(r"([A-Za-z_]+)\.py", paragraphs.get(package, "")))
        problems += [f"layout: taylor_tune/{'' if package == 'root' else package + '/'}{name} is not named in its "
                     "paragraph" for name in names if name not in words and name.rstrip("/") not in words]
    return problems


def setting_problems(text: str) -> list[str]:
    """Every pruning setting the page names (a PruneConfig field in backticks) is a `taylor-tune prune` flag."""
    from taylor_tune.config import PruneConfig

    flags = {flag for action in subparsers()["prune"]._actions for flag in action.option_strings}
    named = set(re.findall(r"`([a-z_]+)`", prose(text))) & set(PruneConfig.model_fields)
    return [f"setting {name}: no taylor-tune prune --{name.replace('_', '-')}" for name in sorted(named)
            if "--" + name.replace("_", "-") not in flags]


def stage_problems(text: str) -> list[str]:
    """The README's chain of a trial's stages is `trial_stages` of a trial that has every optional stage."""
    from taylor_tune.config import Evaluation, PruneConfig, RecoverySpec
    from taylor_tune.sweep.trial import TrialConfig, trial_stages

    chains = [c for c in re.findall(r"`([a-z_N]+(?:\s*->\s*[a-z_N]+)+)`", prose(text)) if c.startswith("start ->")]
    if not chains:
        return ["stages: no `start -> ...` chain"]
    full = TrialConfig(prune=PruneConfig(model="tiny-llama"), evaluation=Evaluation(ppl="world"),
                       recovery=RecoverySpec(evaluate_before=True))
    expected = [re.sub(r"(zero_shot|ppl)_\d+", r"\1_N", stage.name) for stage in trial_stages(full)]
    written = re.split(r"\s*->\s*", chains[0])
    return [] if written == expected else [f"stages: the README says {written}, trial_stages {expected}"]


SHIPPED_ROW = re.compile(r"^\| `(\w+)\.yaml` \| `([^`]+)` \|", re.M)


def searched_as(path: Path) -> str:
    """How an experiment file searches, as docs/sweeps.md's table writes it: `grid`, `tpe + asha`, `grid + race`."""
    from taylor_tune.sweep.experiment import load_experiment

    search = load_experiment(path).search
    return search.algorithm + ("" if search.scheduler == "none" else f" + {search.scheduler}")


def shipped_problems(text: str) -> list[str]:
    """docs/sweeps.md's table of the shipped experiments names every sweep file once, with the search it runs."""
    rows = SHIPPED_ROW.findall(text)
    named = [name for name, _ in rows]
    files = sorted(p for p in (ROOT / "experiments").glob("*.yaml") if not p.stem.startswith("prune_"))
    problems = [f"shipped: {p.name} is not in the table" for p in files if p.stem not in named]
    problems += [f"shipped: {name}.yaml is in the table {named.count(name)} times" for name in sorted(set(named))
                 if named.count(name) > 1]
    for name, written in rows:
        path = ROOT / "experiments" / f"{name}.yaml"
        if not path.is_file():
            problems.append(f"shipped: {name}.yaml: no such experiment")
        elif written != (actual := searched_as(path)):
            problems.append(f"shipped: the table says {name}.yaml runs `{written}`, the file `{actual}`")
    return problems


def problems_of(page: Path, text: str) -> list[str]:
    return (import_problems(text) + name_problems(text) + command_problems(text) + flag_problems(text)
            + link_problems(page, text) + experiment_problems(text) + setting_problems(text)
            + (layout_problems(text) if page.name == "layout.md" else [])
            + (shipped_problems(text) if page.name == "sweeps.md" else [])
            + (stage_problems(text) if page.name == "README.md" else []))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_snippet_name_command_flag_and_link_of_the_page_exists(page, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert problems_of(page, page.read_text()) == []


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert text.index("make demo") < text.index("make test") < 1200  # the two commands, first


@pytest.mark.parametrize("planted, expected", [
    ("```python\nfrom taylor_tune.evaluation.evaluation import evaluate\n```\n", "import taylor_tune.evaluation"),
    ("```python\nfrom taylor_tune.pruning.prune import ProvidedImportance\n```\n", "no such name"),
    ("```\n.venv/bin/taylor-tune sweep experiments/smoke.yaml --resume\n```\n", "taylor-tune sweep --resume"),
    ("```\ntaylor-tune prune --model x \\\n    --num-sample 8\n```\n", "taylor-tune prune --num-sample"),
    ("```\ntaylor-tune tune experiments/smoke.yaml\n```\n", "taylor-tune tune: no such command"),
    ("Use `taylor-tune report PATH --out x`.\n", "taylor-tune report --out"),
    ("Set `--ppl-window-size` to 8.\n", "`--ppl-window-size`"),
    ("`bench/bench_gpu.py --shape llama` times it.\n", "bench/bench_gpu.py --shape: no such option"),
    ("See `taylor_tune.sweep.trial.cached_importance`.\n", "no such name"),
    ("See `taylor_tune/sweep/importance_cache.py`.\n", "no such file"),
    ("See [the methods](docs/method.md).\n", "link docs/method.md"),
    ("```yaml\nname: x\nmodels: [tiny-llama]\nsearch_space: search_spaces/smoke_grid.yaml\nprune: {sparsty: 0.2}\n"
     "```\n", "sparsty"),
])
def test_a_planted_stale_name_is_caught(planted, expected, monkeypatch):
    monkeypatch.chdir(ROOT)
    readme = ROOT / "README.md"
    problems = problems_of(readme, readme.read_text() + "\n" + planted)
    assert any(expected in p for p in problems), problems


def test_a_module_left_out_of_the_layout_is_caught(monkeypatch):
    monkeypatch.chdir(ROOT)
    page = ROOT / "docs" / "layout.md"
    text = page.read_text().replace("speed\n               (prefill", "pace\n               (prefill")
    assert "layout: taylor_tune/evaluation/speed is not named in its paragraph" in problems_of(page, text)


def test_a_documented_setting_that_is_no_flag_is_caught(monkeypatch):
    """With a field left out of prune's flags, a page naming it is caught."""
    import taylor_tune.cli as cli

    monkeypatch.chdir(ROOT)
    derive = cli._add_config_flags
    monkeypatch.setattr(cli, "_add_config_flags", lambda parser, model, skip=(), prefix="": derive(
        parser, model, (*skip, "depth_share"), prefix))
    readme = ROOT / "README.md"
    problems = problems_of(readme, readme.read_text() + "\nA mixed cut sets `depth_share`.\n")
    assert "setting depth_share: no taylor-tune prune --depth-share" in problems


def test_a_stage_missing_from_the_readme_is_caught(monkeypatch):
    monkeypatch.chdir(ROOT)
    readme = ROOT / "README.md"
    text = readme.read_text().replace("before_recovery -> recovery ->", "before_recovery ->")
    assert any(p.startswith("stages: the README says") for p in problems_of(readme, text))


def test_a_shipped_experiment_whose_search_changed_or_that_is_missing_from_the_table_is_caught(monkeypatch):
    """The table of the shipped experiments (docs/sweeps.md) against the files: a row whose search is not the
    file's, a file with no row, a row twice, a row of no file (issue 66, must-show 4: which ones race, stated)."""
    monkeypatch.chdir(ROOT)
    page = ROOT / "docs" / "sweeps.md"
    text = page.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `tpe_asha.yaml` |"))
    written = SHIPPED_ROW.match(row).group(2)
    other = "tpe + race" if written != "tpe + race" else "tpe + asha"
    assert problems_of(page, text.replace(row, row.replace(f"`{written}`", f"`{other}`"))) == [
        f"shipped: the table says tpe_asha.yaml runs `{other}`, the file `{written}`"]
    assert problems_of(page, text.replace(row + "\n", "")) == ["shipped: tpe_asha.yaml is not in the table"]
    assert problems_of(page, text.replace(row, row + "\n" + row)) == ["shipped: tpe_asha.yaml is in the table 2 times"]
    gone = row.replace("`tpe_asha.yaml`", "`tpe_gone.yaml`")
    assert problems_of(page, text.replace(row, row + "\n" + gone)) == ["shipped: tpe_gone.yaml: no such experiment"]
