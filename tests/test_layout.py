"""The package's layout: one subpackage per stage, imports one way (docs/specification.md, "Layout").

export -> sweep -> pruning, recovery, evaluation -> sources, storage -> the root modules; reporting -> storage;
pruning, recovery and evaluation do not import each other; the sweep does not import reporting (export does, to choose
a trial); storage and reporting import no stage but storage; the root modules import no stage (cli aside). Only
storage tells a URI from a folder (`test_only_storage_tells_a_uri_from_a_folder`). The sweep reaches pruning through
its stage module only: `taylor_tune.pruning.prune`, and of it only the names in its `__all__` (the stage functions and
what they return), so that the trial composes pruning's stages instead of reaching into them. `config`, `schema`,
`storage` and `reporting` import neither torch nor ray, not even through the modules they import. A module imports the
project's own modules at its top, unless a comment on the line (or the one above) says why not. The imports are read
with `ast`, so nothing is imported to check them.
"""

import ast
import functools
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "taylor_tune"
STAGES = ("storage", "sources", "pruning", "recovery", "evaluation", "sweep", "reporting", "export")
# what each room may import besides itself ("root": config, schema, errors, jsonio, paired, progress, compat)
ALLOWED = {
    "root": {"root"},
    "storage": {"root"},  # where a sweep's files live: a folder or a bucket, and the shared caches
    "sources": {"root"},
    "pruning": {"storage", "sources", "root"},  # the importance cache
    "recovery": {"sources", "root"},  # beside pruning: its own held-out loss (issue 63, build 3)
    "evaluation": {"storage", "sources", "root"},  # the built requests' cache
    "reporting": {"storage", "root"},
    "sweep": {"pruning", "recovery", "evaluation", "storage", "sources", "root"},
    # a trial's stages again (the sweep's), its pruned folder written (pruning's apply), the trial chosen (reporting),
    # a GGUF checked by recovery's own next-token losses
    "export": {"sweep", "pruning", "recovery", "reporting", "storage", "sources", "root"},
    "cli": {*STAGES, "root"},
}
STAGE_MODULE = "taylor_tune.pruning.prune"  # the one pruning module the sweep may import
HEAVY = ("torch", "ray")  # what the instant parts (validation, statistics) must never load
LIGHT = ("taylor_tune.config", "taylor_tune.schema", "taylor_tune.storage", "taylor_tune.reporting")


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in STAGES:
        return parts[1]
    return "cli" if parts[1:2] in (["cli"], ["__main__"]) else "root"


def imports(path: Path, package: Path) -> tuple[tuple[str, int, bool], ...]:
    """(imported module, line, at module level) for every import in the file; relative imports resolved."""
    here = module_name(path, package).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    try:
        return imports_in(path.read_text(), tuple(here))
    except SyntaxError as error:  # the cache is by text alone, so the file is named here
        error.filename = str(path)
        raise


@functools.cache  # by the text: each planted case copies the package, and all but one of its files are unchanged
def imports_in(text: str, here: tuple[str, ...]) -> tuple[tuple[str, int, bool], ...]:
    here = list(here)
    tree = ast.parse(text)
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            # `from taylor_tune.sources import data` imports the module taylor_tune.sources.data
            names = [f"{base}.{alias.name}" for alias in node.names] if base.startswith("taylor_tune") else [base]
            found += [(name, node.lineno, id(node) in top) for name in names]
    return tuple(found)


def project_files(package: Path) -> dict[str, Path]:
    return {
        module_name(p, package): p for p in sorted(package.rglob("*.py")) if "data" not in p.relative_to(package).parts
    }


def resolve(name: str, modules) -> str | None:
    """The project module an imported name lives in (`taylor_tune.schema.zero_shot_stage` -> `taylor_tune.schema`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def explained(lines: list[str], line: int) -> bool:
    """A comment on the import's line, on another import of its block, or on the line just above the block."""
    index = line - 1
    while index >= 0:
        text = lines[index].strip()
        if "#" in text:
            return True
        if not text.startswith(("from ", "import ")) or index == 0:
            return False
        index -= 1
    return False


def public_names(path: Path) -> set[str]:
    """The names a module lists in its `__all__` (read with ast)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def stage_violation(module: str, name: str, target: str, public: set[str]) -> str | None:
    """Why the sweep may not import `name` (resolved to `target`) of pruning, or None."""
    if room(module) != "sweep" or room(target) != "pruning":
        return None
    if target != STAGE_MODULE:
        return f"{module} imports {target}: the sweep imports pruning through {STAGE_MODULE} only"
    attribute = name.removeprefix(target).lstrip(".")
    if attribute and attribute not in public:
        return f"{module} imports {name}: not in {STAGE_MODULE}.__all__"
    return None


def layout_violations(package: Path = PACKAGE) -> list[str]:
    files = project_files(package)
    graph = {module: imports(path, package) for module, path in files.items()}
    problems = []
    public = public_names(files[STAGE_MODULE]) if STAGE_MODULE in files else set()
    for module, found in graph.items():
        lines = files[module].read_text().splitlines()
        for name, line, at_top in found:
            target = resolve(name, graph) if name.startswith("taylor_tune") else None
            if target is None:
                continue
            if (why := stage_violation(module, name, target, public)) is not None:
                problems.append(f"{module}:{line}: {why}")
            if room(target) != room(module) and room(target) not in ALLOWED[room(module)]:
                problems.append(f"{module}:{line} imports {target}: {room(module)} may not import {room(target)}")
            if not at_top and not explained(lines, line):
                problems.append(f"{module}:{line} imports {target} inside a function without a comment saying why")
    for light in LIGHT:
        seen, todo = set(), [m for m in graph if m == light or m.startswith(light + ".")]
        while todo:
            module = todo.pop()
            if module in seen:
                continue
            seen.add(module)
            for name, line, _ in graph[module]:
                if name.split(".")[0] in HEAVY:
                    problems.append(f"{module}:{line} imports {name}, and {light} must not load {name.split('.')[0]}")
                elif name.startswith("taylor_tune") and (target := resolve(name, graph)):
                    todo.append(target)
    return problems


def test_the_package_keeps_its_layout():
    assert sorted(set(layout_violations())) == []


def test_every_module_sits_in_a_stage_or_is_a_named_root_module():
    root = {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir() if p.is_dir()}
    assert root - {"__pycache__"} == {"__init__", "__main__", "cli", "config", "schema", "errors", "jsonio",
                                      "paired", "progress", "compat", "data", *STAGES}


def uri_tests(package: Path = PACKAGE) -> list[str]:
    """Every line outside `storage` that tells a URI from a folder by its `://` (the storage room's one question)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] in ("storage", "data"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if '"://" in' in line or '"://" not in' in line or "startswith(\"s3://" in line:
                found.append(f"{path.relative_to(package)}:{number}: {line.strip()}")
    return found


def test_only_storage_tells_a_uri_from_a_folder(tmp_path):
    assert uri_tests() == []
    package = tmp_path / "taylor_tune"  # and the check can fail: a planted test of a location's scheme is found
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("data", "__pycache__"))
    (package / "export" / "write.py").write_text((package / "export" / "write.py").read_text()
                                                 + '\n\ndef f(path):\n    return "://" in path\n')
    assert uri_tests(package) == ['export/write.py:' + str(len((package / "export" / "write.py").read_text()
                                                                .splitlines())) + ': return "://" in path']


@pytest.mark.parametrize("where, planted, expected", [
    ("sources/data.py", "from taylor_tune.sweep.trial import run_trial\n", "sources may not import sweep"),
    ("pruning/plan.py", "from taylor_tune.evaluation import perplexity\n", "pruning may not import evaluation"),
    ("reporting/stats.py", "from taylor_tune.sources.data import world_of\n", "reporting may not import sources"),
    ("sweep/race_state.py", "from taylor_tune.reporting import frame\n", "sweep may not import reporting"),
    ("storage/folder.py", "from taylor_tune.sweep import folder\n", "storage may not import sweep"),
    ("storage/cache.py", "import torch\n", "taylor_tune.storage must not load torch"),
    ("schema.py", "from taylor_tune.pruning import plan\n", "root may not import pruning"),
    ("config.py", "import torch\n", "taylor_tune.config must not load torch"),
    ("reporting/latex.py", "import ray.tune\n", "taylor_tune.reporting must not load ray"),
    ("reporting/frame.py", "def f():\n    from taylor_tune import jsonio\n", "inside a function without a comment"),
    ("sweep/trial.py", "from taylor_tune.pruning.importance import compute_importance\n",
     "the sweep imports pruning through taylor_tune.pruning.prune only"),
    ("sweep/preflight.py", "from taylor_tune.pruning.prune import make_plan\n",
     "not in taylor_tune.pruning.prune.__all__"),
])
def test_a_planted_violation_is_caught(tmp_path, where, planted, expected):
    package = tmp_path / "taylor_tune"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("data", "__pycache__"))
    target = package / where
    target.write_text(target.read_text() + "\n" + planted)
    problems = layout_violations(package)
    assert any(expected in p for p in problems), problems
