"""Mutation testing of the core modules with mutmut 3 (configured in pyproject.toml's [tool.mutmut]), scored per
module.

    python scripts/mutation.py run [--modules taylor_tune.reporting.stats,taylor_tune.jsonio]   # resumable
    python scripts/mutation.py run --unjudged --modules taylor_tune.evaluation.scorer           # only those left
    python scripts/mutation.py score --json bench/out/mutation.json                              # the table
    python scripts/mutation.py show taylor_tune.reporting.stats.x_summary__mutmut_3              # its change

`run` with no modules lets mutmut test every configured mutant that has no verdict yet (stopping keeps every verdict;
running again continues; mutmut tests again only the functions whose source changed). Named modules are tested again
whole, so their verdicts are fresh (a test added since counts once mutants/mutmut-stats.json, mutmut's map of which
tests reach which function, is rebuilt: delete it); with `--unjudged`, only their mutants without a verdict, named one
by one (mutmut skips judged mutants only when it is given no names). Each mutant runs against the fast-tier tests
that reach its function.

`score` reads mutmut's verdicts and counts, per module: killed (a test failed; a timeout counts as killed: the mutant
changed behaviour enough to hang a test), survived (every test passed, or no fast-tier test reaches it), equivalent
(a survivor whose change is listed in scripts/mutation_equivalents.yaml with the reason no behaviour can change), and
not yet checked. The score is killed / (killed + survived), equivalents left out.

An equivalent is listed by its function and its change (the lines it removes and adds), not by mutmut's number:
mutmut numbers a function's mutants again whenever the file is mutated again, which would give a listed number to
another mutant.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import json
import re
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MUTMUT = [sys.executable, "-m", "mutmut"]
EQUIVALENTS = ROOT / "scripts" / "mutation_equivalents.yaml"
MUTANTS = ROOT / "mutants"
# mutmut's words for each verdict -> ours
VERDICTS = {"killed": "killed", "timeout": "killed", "survived": "survived", "no tests": "survived",
            "suspicious": "survived", "not checked": "unchecked", "skipped": "unchecked", "segfault": "killed",
            "caught by type check": "killed"}
LINE = re.compile(r"^\s*(?P<name>[\w.ǁ]+__mutmut_\d+): (?P<verdict>.+?)\s*$")


def module_of(mutant: str) -> str:
    """taylor_tune.reporting.stats.x_wilson_interval__mutmut_3 -> taylor_tune.reporting.stats (methods: xǁClassǁ)."""
    return re.split(r"\.x[_ǁ]", mutant, maxsplit=1)[0]


def function_of(mutant: str) -> str:
    """taylor_tune.reporting.stats.x_summary__mutmut_3 -> taylor_tune.reporting.stats.x_summary."""
    return re.sub(r"__mutmut_\d+$", "", mutant)


@functools.cache
def _functions(path: Path) -> dict[str, str]:
    """Every function of a file mutmut mutated: name -> its source (the original as `<name>__mutmut_orig`), as
    ast.get_source_segment gives it but from one split of the text: get_source_segment splits the whole text again
    for each function, minutes on a mutated file of a megabyte and a thousand functions."""
    text = path.read_text(encoding="utf-8")  # line ends read as \n, the only one then (str.splitlines splits on more)
    lines = [line.encode() for line in text.split("\n")]  # ast's columns are bytes

    def source(node: ast.AST) -> str:
        first, last = node.lineno - 1, node.end_lineno - 1
        if first == last:
            return lines[first][node.col_offset : node.end_col_offset].decode()
        head, tail = lines[first][node.col_offset :], lines[last][: node.end_col_offset]
        return b"\n".join([head, *lines[first + 1 : last], tail]).decode()

    return {node.name: source(node) for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def change_of(mutant: str, root: Path = MUTANTS) -> str:
    """The lines a mutant removes (`- `) and adds (`+ `) in its function, stripped, one per line."""
    module, _, name = function_of(mutant).rpartition(".x")
    functions = _functions(root / (module.replace(".", "/") + ".py"))
    number = mutant.rsplit("__mutmut_", 1)[1]

    def lines(suffix: str) -> list[str]:
        source = functions[f"x{name}__mutmut_{suffix}"]
        return [line.strip() for line in source.replace(f"__mutmut_{suffix}", "").splitlines()]

    diff = difflib.unified_diff(lines("orig"), lines(number), lineterm="", n=0)
    return "\n".join(f"{line[0]} {line[1:]}" for line in diff
                     if line[:1] in "+-" and not line.startswith(("+++", "---")) and line[1:])


def equivalents(path: Path = EQUIVALENTS) -> dict[tuple[str, str], str]:
    """(function, change) -> why it cannot change behaviour: a YAML list of {function, change, why}."""
    if not path.is_file():
        return {}
    return {(entry["function"], entry["change"].strip()): entry["why"]
            for entry in yaml.safe_load(path.read_text(encoding="utf-8")) or []}


def drop_stale_copies(root: Path = ROOT, mutants: Path = MUTANTS) -> list[Path]:
    """Remove mutants/' mutated copy (and its .meta, .spans) of every source file changed since it was mutated.

    mutmut 3.8.1 copies a source file into mutants/ only when no copy is there, then measures coverage
    (`mutate_only_covered_lines`) by running the tests on mutants/: for a changed file that is the old mutated copy,
    whose lines are not the new file's, so most of the new file's lines read as uncovered and get no mutants (uniform.py
    got 40 of its 125). Without the copy, mutmut copies the new file, measures it, and mutates it whole."""
    dropped = []
    for meta in sorted(mutants.rglob("*.py.meta")):
        copy = meta.with_suffix("")
        source = root / copy.relative_to(mutants)
        if source.is_file() and copy.is_file() and source.stat().st_mtime > copy.stat().st_mtime:
            for path in (copy, meta, copy.with_name(copy.name + ".spans")):
                path.unlink(missing_ok=True)
            dropped.append(source.relative_to(root))
    return dropped


def unjudged(modules: list[str], mutants: Path = MUTANTS) -> list[str]:
    """The named modules' mutants that have no verdict yet, from the .meta file mutmut keeps beside each mutated copy
    (a module not mutated yet has none: nothing to name)."""
    names = []
    for module in modules:
        meta = mutants / (module.replace(".", "/") + ".py.meta")
        if meta.is_file():
            verdict = json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"]
            names += [name for name, code in verdict.items() if code is None]
    return names


def verdicts(text: str) -> dict[str, str]:
    """`mutmut results --all true`'s lines -> mutant name -> our verdict."""
    out = {}
    for line in text.splitlines():
        match = LINE.match(line)
        if match:
            out[match["name"]] = VERDICTS.get(match["verdict"], "survived")
    return out


def score(found: dict[str, str], equivalent: dict[tuple[str, str], str],
          change: Callable[[str], str] = change_of) -> dict:
    """Per module: the counts, the score and the survivors; and the totals. A survivor whose (function, change) is
    listed in `equivalent` counts as equivalent."""
    counts: dict[str, Counter] = defaultdict(Counter)
    survivors: dict[str, list[str]] = defaultdict(list)
    matched = set()
    for name, verdict in sorted(found.items()):
        module = module_of(name)
        key = (function_of(name), change(name)) if verdict == "survived" else None
        if key in equivalent:
            verdict = "equivalent"
            matched.add(key)
        counts[module][verdict] += 1
        if verdict == "survived":
            survivors[module].append(name)

    def summary(c: Counter) -> dict:
        judged = c["killed"] + c["survived"]
        return {"killed": c["killed"], "survived": c["survived"], "equivalent": c["equivalent"],
                "unchecked": c["unchecked"], "score": c["killed"] / judged if judged else None}

    modules = {m: summary(c) | {"survivors": survivors[m]} for m, c in sorted(counts.items())}
    unmatched = sorted(f"{function}: {lines.splitlines()[-1]}" for function, lines in set(equivalent) - matched)
    return {"modules": modules, "total": summary(sum(counts.values(), Counter())), "unmatched_equivalents": unmatched}


def table(result: dict) -> str:
    lines = ["| module | killed | survived | equivalent | not yet checked | score |", "|---|---:|---:|---:|---:|---:|"]
    for module, m in [*result["modules"].items(), ("all", result["total"])]:
        shown = "–" if m["score"] is None else f"{m['score']:.1%}"
        lines.append(f"| {module} | {m['killed']} | {m['survived']} | {m['equivalent']} | {m['unchecked']} | {shown} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("run", "score", "show"))
    parser.add_argument("mutants", nargs="*", help="show: mutant names")
    parser.add_argument("--modules", default="", help="comma-separated dotted module names (default: all configured)")
    parser.add_argument("--json", type=Path, help="score: write the counts and survivors here")
    parser.add_argument("--unjudged", action="store_true", help="run: only the named modules' mutants with no verdict")
    args = parser.parse_args()
    if args.command == "run":
        modules = [m for m in args.modules.split(",") if m]
        if args.unjudged and not modules:
            sys.exit("--unjudged needs --modules (with no modules, run already tests only the mutants not judged)")
        for path in drop_stale_copies():  # first: a dropped copy's verdicts must not be named below
            print(f"{path} changed since it was mutated: mutated afresh")
        if not args.unjudged:
            names = [f"{m}.x*" for m in modules]
        elif not (names := unjudged(modules)):
            sys.exit(f"nothing left to judge in {args.modules} (or not mutated yet: run it without --unjudged)")
        sys.exit(subprocess.run([*MUTMUT, "run", *names], cwd=ROOT).returncode)
    if args.command == "show":  # in the form an entry of mutation_equivalents.yaml takes
        for name in args.mutants:
            print(f"- function: {function_of(name)}\n  change: |-\n" +
                  "\n".join(f"    {line}" for line in change_of(name).splitlines()) + "\n  why: \n")
        return
    out = subprocess.run([*MUTMUT, "results", "--all", "true"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"mutmut results failed ({out.returncode}): {out.stderr[-2000:]}")
    result = score(verdicts(out.stdout), equivalents())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    if result["unmatched_equivalents"]:  # killed since, or its module's mutants not (yet) tested
        print(f"\n{len(result['unmatched_equivalents'])} listed equivalents match no survivor:",
              *result["unmatched_equivalents"], sep="\n  ")


if __name__ == "__main__":
    main()
