"""A sweep's caches (importance, zero-shot requests, paired speed) check what an entry holds before a trial uses it.

Each test seeds a new experiment folder with a clean sweep's cache folders, damages one entry the way issue 37's
adversarial run did (well-formed but altered, or parsable but incomplete; with its checksum left stale and with it
recomputed), and runs a trial there: the entry is refused, removed and built again, and the trial's results are the
clean trial's. On 1faffce the altered entries were used (PIQA 0.0, ppl 6.12 for 1.50, decode_speedup 0.002x) and the
incomplete ones made every trial error.
"""

import json
import os
import shutil

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from taylor_tune.config import Evaluation, PruneConfig, SpeedSpec
from taylor_tune.jsonio import entry_text
from taylor_tune.pruning.importance_cache import CHECKSUM, tensors_sha256
from taylor_tune.storage.cache import Store, built_json, json_name
from taylor_tune.sweep.trial import TrialConfig, run_trial

pytestmark = pytest.mark.slow
CACHES = ("importance_cache", "requests", "paired_speed")
SPEED = SpeedSpec(prefill_batch=1, prefill_len=16, decode_batch=2, prompt_len=8, new_tokens=2, context=64, repeats=1,
                  warmup=0)


def trial(experiment) -> TrialConfig:
    return TrialConfig(
        prune=PruneConfig(model="tiny-llama", method="taylor", seq_len=32, num_samples=8, calibration="world",
                          device="cpu", dtype="float32"),
        evaluation=Evaluation(tasks="piqa,hellaswag", task_data="world", ppl="world", batch_size=16, fidelities=[6],
                              speed=SPEED),
        cache_dir=str(experiment / "importance_cache"),
    )


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A clean sweep's experiment folder after one trial, and that trial's metrics and removed groups."""
    experiment = tmp_path_factory.mktemp("clean")
    metrics = run_trial(trial(experiment), experiment / "trial")
    return experiment, metrics, removed(experiment / "trial")


def removed(trial_dir):
    return json.loads((trial_dir / "pruning_summary.json").read_text())["removed_groups"]


def seeded(clean_folder, tmp_path):
    experiment = tmp_path / "seeded"
    for name in CACHES:
        shutil.copytree(clean_folder / name, experiment / name, ignore=shutil.ignore_patterns("*.lock", "events*"))
    return experiment


def without_answer_keys(experiment):
    """The sweep's answer keys removed (issue 84): a later trial then reads the requests' entries, as here tested."""
    for key in (experiment / "requests").glob("*.answers"):
        key.unlink()
    return experiment


def json_entry(folder, **header_fields):
    """(path, header, payload) of the one JSON entry whose fields include `header_fields`."""
    for path in sorted(folder.glob("*.json")):
        line, _, payload = path.read_text().partition("\n")
        header = json.loads(line)
        if all(header["fields"].get(k) == v for k, v in header_fields.items()):
            return path, header, json.loads(payload)
    raise AssertionError(f"no entry with {header_fields} in {folder}")


def rewrite(path, header, payload, *, checksum: bool):
    """The entry with `payload`: its checksum recomputed (`checksum`), or the old one left in place."""
    if checksum:
        path.write_text(entry_text(header["fields"], header["part"], payload))
    else:
        path.write_text(json.dumps(header, separators=(",", ":")) + "\n" + json.dumps(payload, separators=(",", ":")))


def importance_entry(experiment):
    """(path, metadata, tensors) of the one importance entry."""
    (entry,) = (experiment / "importance_cache").glob("*.safetensors")
    with safe_open(str(entry), framework="pt") as handle:
        return entry, handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}


def scores(metrics):
    return {k: v for k, v in metrics.items() if k.startswith("acc_")}


@pytest.mark.parametrize("swapped", [(7,), (5, 7)], ids=["tokens", "text-and-tokens"])
@pytest.mark.parametrize("checksum", [False, True], ids=["stale-checksum", "recomputed-checksum"])
def test_a_request_entry_with_two_choices_swapped_is_rebuilt(clean, tmp_path, checksum, swapped):
    """The tokens of two choices swapped, or (issue 62, finding 4) their text and tokens together, so that text and
    tokens agree and only lm-eval's own choice for each request can tell (PIQA 0.0 on dc4d04a)."""
    clean_folder, clean_metrics, _ = clean
    experiment = without_answer_keys(seeded(clean_folder, tmp_path))
    path, header, rows = json_entry(experiment / "requests", task="piqa_offline")
    for doc in {row[0] for row in rows}:  # every document's two choices
        first, second = (i for i, row in enumerate(rows) if row[0] == doc)
        for column in swapped:
            rows[first][column], rows[second][column] = rows[second][column], rows[first][column]
    rewrite(path, header, rows, checksum=checksum)
    metrics = run_trial(trial(experiment), experiment / "trial")
    assert metrics["zero_shot_6_requests_built"] == 1  # PIQA's entry, refused and built again; HellaSwag's read
    assert scores(metrics) == scores(clean_metrics)
    assert path.read_text() == (clean_folder / "requests" / path.name).read_text()


@pytest.mark.parametrize("attack", ["piqa gold on the next choice", "hellaswag's next item's context tokens"])
def test_an_answer_key_edited_with_its_checksum_recomputed_is_rebuilt_and_the_trial_scores_as_clean(clean, tmp_path,
                                                                                                   attack):
    """Issue 91, case 2: each piqa item's gold flag moved to the next choice, or each item given the next item's
    context tokens, the key's checksum recomputed: the key was used unread (acc_piqa 0.0 where it is 1.0). Now the
    trial's accuracies are the clean trial's, its pass scored that task through lm-eval again (the key refused as
    damaged) and the key is made again as it was."""
    import dataclasses

    import numpy as np

    from taylor_tune.evaluation.answers import AnswerKey, worker_keys

    clean_folder, clean_metrics, _ = clean
    experiment = seeded(clean_folder, tmp_path)
    task = "piqa_offline" if attack.startswith("piqa") else "hellaswag_offline"
    (path,) = [p for p in (experiment / "requests").glob("*.answers")
               if json.loads(p.read_bytes().partition(b"\n")[0])["task"] == task]
    original = path.read_bytes()
    fields = json.loads(original.partition(b"\n")[0])["fields"]
    key = AnswerKey.from_bytes(original, fields)
    starts = np.flatnonzero(np.r_[True, key.doc_id[1:] != key.doc_id[:-1]])
    if task == "piqa_offline":  # every item's gold on the next choice
        gold = np.zeros_like(key.gold)
        for start, end in zip(starts, [*starts[1:], len(key.gold)]):
            at = start + (int(np.flatnonzero(key.gold[start:end])[0]) + 1) % (end - start)
            gold[at] = True
        edited = dataclasses.replace(key, gold=gold)
    else:  # every request given the first request's context of the next item
        nxt = {int(s): int(starts[(i + 1) % len(starts)]) for i, s in enumerate(starts)}
        item = np.searchsorted(starts, np.arange(len(key.idx)), side="right") - 1
        edited = dataclasses.replace(key, contexts=[key.contexts[nxt[int(starts[i])]] for i in item])
    path.write_bytes(edited.to_bytes(fields))  # its checksum recomputed
    worker_keys().held.clear()  # a new worker: the key is read from the store
    metrics = run_trial(trial(experiment), experiment / "trial")
    assert scores(metrics) == scores(clean_metrics)
    assert path.read_bytes() == original
    damaged = [e for e in Store(experiment / "requests").events() if e["event"] == "damaged"]
    assert [e["key"] for e in damaged] == [path.name.split(".")[0]]


def test_a_request_entry_missing_rows_is_rebuilt_not_an_error(clean, tmp_path):
    """Finding 3: a parsable entry (its checksum recomputed) without one document's requests."""
    clean_folder, clean_metrics, _ = clean
    experiment = without_answer_keys(seeded(clean_folder, tmp_path))
    path, header, rows = json_entry(experiment / "requests", task="hellaswag_offline")
    rewrite(path, header, [row for row in rows if row[0] != rows[-1][0]], checksum=True)
    metrics = run_trial(trial(experiment), experiment / "trial")
    assert metrics["zero_shot_6_requests_built"] == 1 and scores(metrics) == scores(clean_metrics)


@pytest.mark.parametrize("damage", ["times-100-stale-checksum", "times-100-recomputed-checksum",
                                    "empty-recomputed-checksum", "negative-recomputed-checksum",
                                    "unpruned-decode-times-100", "unpruned-prefill-1e12"])
def test_a_speed_record_that_is_altered_or_incomplete_is_measured_again(clean, tmp_path, damage):
    """Finding 2 (a record x100) and 3 (`"measured": {}`, every trial errored with KeyError), on the record a
    same-shape trial reuses: measured again. x100 with the checksum recomputed is caught by what the numbers mean
    (issue 62, finding 4): no structured pruning makes a model 20 times faster."""
    clean_folder, clean_metrics, _ = clean
    experiment = seeded(clean_folder, tmp_path)
    path, header, measured = json_entry(experiment / "paired_speed")
    if damage.startswith("times-100"):
        rewrite(path, header, {k: None if v is None else v * 100 for k, v in measured.items()},
                checksum=damage.endswith("recomputed-checksum"))
    elif damage.startswith("empty"):
        rewrite(path, header, {}, checksum=True)
    elif damage.startswith("unpruned"):  # issue 80: the baseline's rate alone, the checksum recomputed
        rate = "unpruned_decode_tokens_per_s" if "decode" in damage else "unpruned_prefill_tokens_per_s"
        damaged = measured[rate] * 100 if "decode" in damage else 1e12
        rewrite(path, header, measured | {rate: damaged}, checksum=True)
    else:
        rewrite(path, header, measured | {"decode_tokens_per_s": -measured["decode_tokens_per_s"]}, checksum=True)
    metrics = run_trial(trial(experiment), experiment / "trial")
    assert metrics["speed_reused"] is False  # this trial timed the pair again
    _, _, stored = json_entry(experiment / "paired_speed")
    assert metrics["decode_tokens_per_s"] == stored["decode_tokens_per_s"] > 0
    assert metrics["decode_speedup"] == stored["decode_speedup"] < 20
    if damage.startswith("unpruned"):  # the baseline's rate as timed again, not the record's
        assert metrics[rate] == stored[rate] != damaged
    assert stored["weight_bytes"] == measured["weight_bytes"]  # bytes are exact: the same model measured
    assert metrics["memory_ratio"] == clean_metrics["memory_ratio"] < 1


def test_an_intact_speed_record_is_read_by_a_trial_of_the_same_shapes(clean, tmp_path):
    clean_folder, clean_metrics, _ = clean
    experiment = seeded(clean_folder, tmp_path)
    metrics = run_trial(trial(experiment), experiment / "trial")
    assert metrics["speed_reused"] is True and "speed_timed_from" not in metrics
    speed = [k for k in clean_metrics if "speedup" in k or k.endswith("tokens_per_s") or k.startswith("unpruned_")]
    assert len(speed) > 10 and {k: metrics[k] for k in speed} == {k: clean_metrics[k] for k in speed}


@pytest.mark.parametrize("checksum", [False, True], ids=["stale-checksum", "recomputed-checksum"])
def test_negated_importance_scores_are_computed_again(clean, tmp_path, checksum):
    clean_folder, clean_metrics, clean_removed = clean
    experiment = seeded(clean_folder, tmp_path)
    entry, metadata, tensors = importance_entry(experiment)
    tensors = {name: -t if "scores" in name else t for name, t in tensors.items()}
    if checksum:
        metadata[CHECKSUM] = tensors_sha256(tensors)
    save_file(tensors, str(entry), metadata=metadata)
    metrics = run_trial(trial(experiment), experiment / "trial")
    assert metrics["importance_cache"] == "computed"
    assert metrics["ppl"] == clean_metrics["ppl"] and removed(experiment / "trial") == clean_removed
    events = Store(experiment / "importance_cache").events()
    assert [e["event"] for e in events] == ["damaged", "computed"]
    assert ("non-finite" in events[0]["error"]) == checksum  # the check; else the checksum caught it first


def test_scores_of_another_shape_are_computed_again(clean, tmp_path):
    """An entry holding one layer's scores cut short (its checksum recomputed): not the model's layout."""
    clean_folder, _, clean_removed = clean
    experiment = seeded(clean_folder, tmp_path)
    entry, metadata, tensors = importance_entry(experiment)
    name = next(n for n in sorted(tensors) if n.endswith("mlp_scores"))
    tensors[name] = tensors[name][:-1].clone()
    metadata[CHECKSUM] = tensors_sha256(tensors)
    save_file(tensors, str(entry), metadata=metadata)
    metrics = run_trial(trial(experiment), experiment / "trial")
    assert metrics["importance_cache"] == "computed" and removed(experiment / "trial") == clean_removed


# ---------------------------------------------------------------- finding 1: links in cache folders

@pytest.mark.parametrize("cache", ["requests", "paired_speed", "importance_cache"])
def test_a_lock_or_log_file_that_is_a_link_does_not_write_through_it(clean, tmp_path, cache):
    """Finding 1: `ln -sf OUTSIDE <exp>/<cache>/<key>.lock` (and events.jsonl, and a hard link): OUTSIDE is left as
    it was (on 1faffce it was truncated to 0 bytes, or appended to), and the trial runs. A lock is only ever
    created with O_EXCL, and a hit takes none: a link at a lock's name is written through by nothing."""
    clean_folder, clean_metrics, _ = clean
    experiment = seeded(clean_folder, tmp_path)
    outside, hard = tmp_path / "OUTSIDE", tmp_path / "HARD"
    outside.write_text("precious\n")
    hard.write_text("precious too\n")
    folder = experiment / cache
    if cache == "importance_cache":
        for path in sorted(folder.glob("*.safetensors")):
            path.unlink()  # computed again: the lease is taken and events are logged
            path.with_suffix(".lock").symlink_to(outside)
        (folder / "events.jsonl").symlink_to(outside)  # an older sweep's log: only ever read, never through a link
        targets = sorted(folder.glob("*.lock"))
    else:
        targets = [p.with_suffix(".lock") for p in sorted(folder.glob("*.json"))]
        for path in targets[1:]:
            path.symlink_to(outside)
        os.link(hard, targets[0])
    metrics = run_trial(trial(experiment), experiment / "trial")
    assert outside.read_text() == "precious\n" and hard.read_text() == "precious too\n"
    assert scores(metrics) == scores(clean_metrics)
    if cache == "importance_cache":  # each link removed (the link only), the lease taken, then let go
        assert targets and not any(path.exists() or path.is_symlink() for path in targets)


def test_a_lock_of_the_entry_being_built_that_is_a_link_is_replaced(tmp_path):
    outside = tmp_path / "OUTSIDE"
    outside.write_text("precious\n")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / json_name({"a": 1}).replace(".json", ".lock")).symlink_to(outside)
    value, built = built_json(Store(tmp_path / "cache"), {"a": 1}, lambda: [1, 2], list)
    assert (value, built) == ([1, 2], True) and outside.read_text() == "precious\n"
