"""`make mutation`'s score (scripts/mutation.py) against a count by hand of mutmut's verdict lines."""

import collections

from scripts.mutation import equivalents, module_of, score, table, verdicts

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
    listed = tmp_path / "equivalents.txt"
    listed.write_text("# a comment line\ntaylor_tune.reporting.stats.x_wilson_interval__mutmut_6  # why: a reason\n")
    equal = equivalents(listed)
    assert equal == {"taylor_tune.reporting.stats.x_wilson_interval__mutmut_6": "why: a reason"}
    result = score(found, equal)

    by_hand = collections.defaultdict(collections.Counter)
    for line in RESULTS.splitlines()[:-1]:
        name, verdict = line.strip().rsplit(": ", 1)
        module = name.split(".x_")[0].split(".xǁ")[0]
        kind = ("equivalent" if name in equal else "killed" if verdict in ("killed", "timeout")
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
