"""Mutation testing of the core modules with mutmut 3 (configured in pyproject.toml's [tool.mutmut]), scored per
module.

    python scripts/mutation.py run [--modules taylor_tune.reporting.stats,taylor_tune.jsonio]   # resumable
    python scripts/mutation.py score --json bench/out/mutation.json                              # the table

`run` lets mutmut test every mutant of the chosen modules (all of [tool.mutmut]'s when none are named) that has no
verdict yet: stopping it keeps every verdict, and running it again continues (mutmut tests again only the functions
whose source changed). Each mutant runs against the fast-tier tests that reach its function.

`score` reads mutmut's verdicts and counts, per module: killed (a test failed; a timeout counts as killed: the mutant
changed behaviour enough to hang a test), survived (every test passed, or no fast-tier test reaches it), equivalent
(listed in scripts/mutation_equivalents.txt with the reason no behaviour can change), and not yet checked. The score
is killed / (killed + survived), equivalents left out.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTMUT = [sys.executable, "-m", "mutmut"]
EQUIVALENTS = ROOT / "scripts" / "mutation_equivalents.txt"
# mutmut's words for each verdict -> ours
VERDICTS = {"killed": "killed", "timeout": "killed", "survived": "survived", "no tests": "survived",
            "suspicious": "survived", "not checked": "unchecked", "skipped": "unchecked", "segfault": "killed",
            "caught by type check": "killed"}
LINE = re.compile(r"^\s*(?P<name>[\w.ǁ]+__mutmut_\d+): (?P<verdict>.+?)\s*$")


def module_of(mutant: str) -> str:
    """taylor_tune.reporting.stats.x_wilson_interval__mutmut_3 -> taylor_tune.reporting.stats (methods: xǁClassǁ)."""
    return re.split(r"\.x[_ǁ]", mutant, maxsplit=1)[0]


def equivalents(path: Path = EQUIVALENTS) -> dict[str, str]:
    """mutant name -> why it cannot change behaviour (one per line: `name  # reason`)."""
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, reason = line.partition("#")
            out[name.strip()] = reason.strip()
    return out


def verdicts(text: str) -> dict[str, str]:
    """`mutmut results --all true`'s lines -> mutant name -> our verdict."""
    out = {}
    for line in text.splitlines():
        match = LINE.match(line)
        if match:
            out[match["name"]] = VERDICTS.get(match["verdict"], "survived")
    return out


def score(found: dict[str, str], equivalent: dict[str, str]) -> dict:
    """Per module: the counts, the score and the survivors; and the totals."""
    counts: dict[str, Counter] = defaultdict(Counter)
    survivors: dict[str, list[str]] = defaultdict(list)
    for name, verdict in sorted(found.items()):
        module = module_of(name)
        verdict = "equivalent" if name in equivalent else verdict
        counts[module][verdict] += 1
        if verdict == "survived":
            survivors[module].append(name)

    def summary(c: Counter) -> dict:
        judged = c["killed"] + c["survived"]
        return {"killed": c["killed"], "survived": c["survived"], "equivalent": c["equivalent"],
                "unchecked": c["unchecked"], "score": c["killed"] / judged if judged else None}

    modules = {m: summary(c) | {"survivors": survivors[m]} for m, c in sorted(counts.items())}
    return {"modules": modules, "total": summary(sum(counts.values(), Counter()))}


def table(result: dict) -> str:
    lines = ["| module | killed | survived | equivalent | not yet checked | score |", "|---|---:|---:|---:|---:|---:|"]
    for module, m in [*result["modules"].items(), ("all", result["total"])]:
        shown = "–" if m["score"] is None else f"{m['score']:.1%}"
        lines.append(f"| {module} | {m['killed']} | {m['survived']} | {m['equivalent']} | {m['unchecked']} | {shown} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("run", "score"))
    parser.add_argument("--modules", default="", help="comma-separated dotted module names (default: all configured)")
    parser.add_argument("--json", type=Path, help="score: write the counts and survivors here")
    args = parser.parse_args()
    if args.command == "run":
        names = [f"{m}.x*" for m in args.modules.split(",") if m]
        sys.exit(subprocess.run([*MUTMUT, "run", *names], cwd=ROOT).returncode)
    out = subprocess.run([*MUTMUT, "results", "--all", "true"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"mutmut results failed ({out.returncode}): {out.stderr[-2000:]}")
    result = score(verdicts(out.stdout), equivalents())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
