"""`make mutation`'s score (scripts/mutation.py) against a count by hand of mutmut's verdict lines; a mutant's change
read from a file laid out as mutmut writes it, and an equivalent recognized by its change whatever its number."""

import collections
import textwrap
from pathlib import Path

from scripts.mutation import change_of, equivalents, function_of, module_of, score, table, verdicts

RESULTS = """\
    taylor_tune.jsonio.x_read_json__mutmut_1: killed
    taylor_tune.jsonio.x_read_json__mutmut_2: survived
    taylor_tune.jsonio.x_read_json__mutmut_3: timeout
    taylor_tune.jsonio.x_write_json__mutmut_1: no tests
    taylor_tune.jsonio.x_write_json__mutmut_2: not checked
    taylor_tune.reporting.stats.xǁObjectiveǁbest_index__mutmut_1: killed
    taylor_tune.reporting.stats.xǁObjectiveǁbest_index__mutmut_2: survived
    taylor_tune.reporting.stats.x_wilson_interval__mutmut_6: survived
⠋ a spinner line mutmut prints is not a verdict
"""


def test_the_score_per_module_equals_a_count_by_hand(tmp_path):
    found = verdicts(RESULTS)
    assert len(found) == 8 and found["taylor_tune.jsonio.x_read_json__mutmut_3"] == "killed"
    assert module_of("taylor_tune.reporting.stats.xǁObjectiveǁbest_index__mutmut_1") == "taylor_tune.reporting.stats"
    listed = tmp_path / "equivalents.yaml"
    listed.write_text("# a comment line\n- function: taylor_tune.reporting.stats.x_wilson_interval\n"
                      "  change: |-\n    - if n > 0:\n    + if n >= 0:\n  why: a reason\n")
    equal = equivalents(listed)
    assert equal == {("taylor_tune.reporting.stats.x_wilson_interval", "- if n > 0:\n+ if n >= 0:"): "a reason"}
    changes = collections.defaultdict(lambda: "- a\n+ b", {
        "taylor_tune.reporting.stats.x_wilson_interval__mutmut_6": "- if n > 0:\n+ if n >= 0:",
        "taylor_tune.jsonio.x_read_json__mutmut_2": "- if n > 0:\n+ if n >= 0:"})  # same change, other function
    result = score(found, equal, changes.__getitem__)

    by_hand = collections.defaultdict(collections.Counter)
    for line in RESULTS.splitlines()[:-1]:
        name, verdict = line.strip().rsplit(": ", 1)
        module = name.split(".x_")[0].split(".xǁ")[0]
        kind = ("equivalent" if name.endswith("wilson_interval__mutmut_6") else "killed" if verdict in ("killed",
                                                                                                       "timeout")
                else "unchecked" if verdict == "not checked" else "survived")
        by_hand[module][kind] += 1
    for module, counts in by_hand.items():
        got = result["modules"][module]
        assert {k: got[k] for k in ("killed", "survived", "equivalent", "unchecked")} == {
            k: counts[k] for k in ("killed", "survived", "equivalent", "unchecked")}
        assert got["score"] == counts["killed"] / (counts["killed"] + counts["survived"])
    assert result["modules"]["taylor_tune.jsonio"]["survivors"] == [
        "taylor_tune.jsonio.x_read_json__mutmut_2", "taylor_tune.jsonio.x_write_json__mutmut_1"]
    assert result["total"]["killed"] == 3 and result["total"]["survived"] == 3 and result["total"]["score"] == 0.5
    assert "| taylor_tune.reporting.stats | 1 | 1 | 1 | 0 | 50.0% |" in table(result)
    assert result["unmatched_equivalents"] == []
    stale = {("taylor_tune.jsonio.x_write_json", "- a\n+ c"): "listed, but no survivor has this change"}
    assert score(found, equal | stale, changes.__getitem__)["unmatched_equivalents"] == [
        "taylor_tune.jsonio.x_write_json: + c"]


def test_a_mutants_change_is_read_from_the_mutated_file_whatever_its_number(tmp_path):
    # the layout mutmut writes: each function's original as <name>__mutmut_orig beside its numbered mutants
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(textwrap.dedent("""\
        def x_f__mutmut_orig(n):
            a = n + 1
            return a * 2
        def x_f__mutmut_1(n):
            a = n - 1
            return a * 2
        def x_f__mutmut_7(n):
            a = n + 1
            return a / 2
        class C:
            def xǁCǁg__mutmut_orig(self, k=0):
                return k
            def xǁCǁg__mutmut_2(self, k=1):
                return k
        """))
    assert change_of("pkg.mod.x_f__mutmut_1", tmp_path) == "- a = n + 1\n+ a = n - 1"
    assert change_of("pkg.mod.x_f__mutmut_7", tmp_path) == "- return a * 2\n+ return a / 2"
    assert change_of("pkg.mod.xǁCǁg__mutmut_2", tmp_path) == "- def xǁCǁg(self, k=0):\n+ def xǁCǁg(self, k=1):"
    assert function_of("pkg.mod.xǁCǁg__mutmut_2") == "pkg.mod.xǁCǁg"


def test_functions_are_read_as_ast_get_source_segment_gives_them(tmp_path):
    """_functions reads every function's source from one split of the text: the same text as ast's own
    get_source_segment (which splits it again per function) of the text as read, with non-ASCII names and strings
    (columns are bytes), a comment after the last line, one-line and nested functions, decorators, a form feed (a
    line end to str.splitlines, not to ast) and Windows line ends."""
    import ast

    from scripts.mutation import _functions

    text = textwrap.dedent("""\
        import functools
        def xǁCǁg__mutmut_orig(self, k="ä"): return k  # one line, non-ASCII before the end
        @functools.cache
        def f(n):
            def inner(m):  # nested
                return "€" + m
            return inner(n)  # a comment after the function's end
        class C:
            \f
            async def h(self):
                return 1; x = 2
        """)
    for name, source in (("unix.py", text), ("windows.py", text.replace("\n", "\r\n"))):
        (tmp_path / name).write_bytes(source.encode())
        read = (tmp_path / name).read_text(encoding="utf-8")
        expected = {node.name: ast.get_source_segment(read, node) for node in ast.walk(ast.parse(read))
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
        assert set(expected) == {"xǁCǁg__mutmut_orig", "f", "inner", "h"}
        assert _functions(tmp_path / name) == expected, name


def test_a_changed_sources_mutated_copy_is_dropped_and_an_unchanged_ones_kept(tmp_path):
    import os

    from scripts.mutation import drop_stale_copies

    root, mutants = tmp_path, tmp_path / "mutants"
    for name, changed in (("pkg/a.py", True), ("pkg/b.py", False)):
        source, copy = root / name, mutants / name
        source.parent.mkdir(parents=True, exist_ok=True)
        copy.parent.mkdir(parents=True, exist_ok=True)
        for path in (source, copy, copy.with_name(copy.name + ".meta"), copy.with_name(copy.name + ".spans")):
            path.write_text("x")
        os.utime(source, (1000, 2000 if changed else 500))
        os.utime(copy, (1000, 1000))
    (mutants / "pkg" / "c.py").write_text("copied, never mutated: no .meta")
    assert drop_stale_copies(root, mutants) == [Path("pkg/a.py")]
    assert sorted(p.name for p in (mutants / "pkg").iterdir()) == ["b.py", "b.py.meta", "b.py.spans", "c.py"]


def test_unjudged_names_each_mutant_without_a_verdict_of_the_named_modules_only(tmp_path):
    """`run --unjudged` names to mutmut the mutants whose verdict in mutmut's .meta file is still None (1 killed, 0
    survived, -6 suspicious are verdicts), of the modules named and no other; a module never mutated has no file."""
    import json

    from scripts.mutation import unjudged

    verdicts = {"pkg.a": {"pkg.a.x_f__mutmut_1": 1, "pkg.a.x_f__mutmut_2": None, "pkg.a.xǁCǁg__mutmut_1": 0,
                          "pkg.a.xǁCǁg__mutmut_2": None, "pkg.a.x_h__mutmut_1": -6},
                "pkg.sub.b": {"pkg.sub.b.x_k__mutmut_1": None}}
    for module, codes in verdicts.items():
        meta = tmp_path / (module.replace(".", "/") + ".py.meta")
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({"exit_code_by_key": codes, "durations_by_key": {}}), encoding="utf-8")
    expected = {module: [name for name, code in codes.items() if code is None] for module, codes in verdicts.items()}
    assert unjudged(["pkg.a"], tmp_path) == expected["pkg.a"] == ["pkg.a.x_f__mutmut_2", "pkg.a.xǁCǁg__mutmut_2"]
    assert unjudged(["pkg.sub.b", "pkg.a"], tmp_path) == expected["pkg.sub.b"] + expected["pkg.a"]
    assert unjudged(["pkg.never_mutated"], tmp_path) == []

