"""A zero-shot pass's requests built once (issue 30, point 4): equal to lm-eval's own, reused by a model's later trials,
never by another tokenizer or limit, built once when processes ask at once, built again when damaged."""

import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from types import SimpleNamespace

import pytest
from lm_eval import simple_evaluate

from taylor_tune.compat.lm_eval import without_environment_record
from taylor_tune.config import EvalSpec, Evaluation, PruneConfig
from taylor_tune.evaluation import zero_shot as zero_shot_module
from taylor_tune.evaluation.answers import worker_keys
from taylor_tune.evaluation.requests import PassRequests, RequestCache, tokenizer_digest
from taylor_tune.evaluation.scorer import PrefixLM
from taylor_tune.jsonio import entry_text, read_entry
from taylor_tune.sources.models import load_tokenizer
from taylor_tune.sweep.trial import TrialConfig, run_trial
from tests.helpers import tiny


class Recording(PrefixLM):
    """Records what lm-eval hands the scorer (the requests and their tokens) and answers from the tokens alone."""

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, override_bs=None):
        self.seen.extend(requests)
        return [(-len(context) - sum(continuation) / 1e4, len(continuation) % 2 == 0)
                for _, context, continuation in requests]


def recording_lm(tokenizer) -> Recording:
    lm = Recording(pretrained=tiny("tiny-llama-random"), tokenizer=tokenizer, device="cpu", batch_size=16)
    lm.scorer, lm.seen = "prefix", []
    return lm


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m", "qwen2.5-0.5b"])
def test_requests_built_once_and_read_back_equal_lm_evals_own(assets, model, tmp_path):
    """The seven real tasks at 25 items each, with each real model's tokenizer: what the scorer receives (every
    request's strings and tokens, in order) and lm-eval's results and per-item samples (documents, arguments, answers,
    metrics, hashes) are the same from lm-eval's stock simple_evaluate, from a pass that builds and stores the requests
    (templates compiled once, tokenized once), and from a pass that reads them back (lm-eval builds none)."""
    spec = EvalSpec(task_data="real", limit=25, ppl=None)
    sources = [zero_shot_module.task_source(task, "real") for task in spec.tasks]
    lm = recording_lm(load_tokenizer(model))
    with without_environment_record():
        stock = simple_evaluate(model=lm, tasks=[s for s, _ in sources], task_manager=sources[0][1], limit=spec.limit,
                                bootstrap_iters=1000, log_samples=True, verbosity="ERROR")
    stock_seen, lm.seen = lm.seen, []
    cache, passes = RequestCache(tmp_path / "requests"), []
    for _ in range(2):
        requests = PassRequests(lm, cache)
        result = zero_shot_module._simple_evaluate(lm, spec, sources, requests)
        passes.append((requests.built, lm.seen, result))
        lm.seen = []
    assert [built for built, _, _ in passes] == [7, 0]
    assert len(stock_seen) > 7 * 25 * 2
    for _, seen, result in passes:
        assert seen == stock_seen
        assert result["results"] == stock["results"]
        assert result["samples"] == stock["samples"]
    assert lm.encoded is None  # the pass's tokens are dropped with it


def trial(model: str, limit: int, cache_dir) -> TrialConfig:
    return TrialConfig(
        prune=PruneConfig(model=model, method="taylor", seq_len=32, num_samples=8, calibration="world", device="cpu",
                          dtype="float32"),
        evaluation=Evaluation(tasks="piqa,hellaswag,arc_easy", task_data="world", ppl=None, batch_size=16,
                              fidelities=[limit]),
        cache_dir=str(cache_dir),
    )


@pytest.mark.slow
def test_a_models_second_trial_reuses_its_requests_and_another_tokenizer_or_limit_does_not(tmp_path, monkeypatch):
    """Must show 3: through `run_trial` with a sweep's cache folder. The model's first trial builds its three tasks'
    requests; the second (the same model, tokenizer and limit) builds none: lm-eval constructs no request and nothing
    is tokenized (it answers from the answer keys the first kept, issue 84), and its answers are the first trial's.
    Another limit, and another tokenizer (tiny-llama-random's byte tokenizer instead of the world's), build their
    own; a second trial whose keys are gone reads the requests back, constructs none, and tokenizes each request
    once to check the entry (2 encodings per request, context and context+continuation, as the build's own; lm-eval's
    tokenization runs twice, a dry run recording the texts that are then encoded in one batch, so 4 tok_encode calls
    per request)."""
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.models.huggingface import HFLM

    calls = {"construct_requests": 0, "tok_encode": 0}

    def counting(name, original):
        def counted(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        return counted

    for cls, name in ((ConfigurableTask, "construct_requests"), (HFLM, "tok_encode")):
        monkeypatch.setattr(cls, name, counting(name, getattr(cls, name)))

    cache_dir, runs = tmp_path / "importance_cache", []
    for index, (model, limit) in enumerate([("tiny-llama", 6), ("tiny-llama", 6), ("tiny-llama", 8),
                                            ("tiny-llama-random", 6), ("tiny-llama-random", 6)]):
        calls.update(construct_requests=0, tok_encode=0)
        if index == 4:  # no answer keys: the requests read back
            worker_keys().held.clear()
            for key in (tmp_path / "requests").glob("*.answers"):
                key.unlink()
        metrics = run_trial(trial(model, limit, cache_dir), tmp_path / f"t{index}")
        runs.append((metrics[f"zero_shot_{limit}_requests_built"], dict(calls), metrics))
    built = [b for b, _, _ in runs]
    assert built == [3, 0, 3, 3, 0]
    assert runs[0][1]["construct_requests"] > 0 and runs[0][1]["tok_encode"] > 0
    assert runs[1][1] == {"construct_requests": 0, "tok_encode": 0}
    # the entries run 4 read are run 3's (the last written): each of their requests tokenized once, 2 encodings
    read_back = sorted((tmp_path / "requests").glob("*.json"), key=lambda p: p.stat().st_mtime_ns)[-3:]
    requests = sum(len(json.loads(p.read_bytes().partition(b"\n")[2])) for p in read_back)
    assert requests > 3 * 6 and runs[4][1] == {"construct_requests": 0, "tok_encode": 2 * 2 * requests}
    scores = lambda m: {k: v for k, v in m.items() if k.startswith("acc_")}
    assert scores(runs[0][2]) == scores(runs[1][2]) and scores(runs[3][2]) == scores(runs[4][2])
    assert 0 < runs[1][2]["zero_shot_6_requests_s"] < runs[1][2]["zero_shot_6_s"]
    assert len(list((tmp_path / "requests").glob("*.json"))) == 9  # 3 tasks × (2 limits + 1 more tokenizer)


def test_the_tokenizer_digest_follows_what_tokenizes(tmp_path):
    """Equal for a saved and reloaded copy; different when one token is added, and when HFLM's settings differ."""
    world = load_tokenizer("tiny-llama")
    lm = recording_lm(world)
    world.save_pretrained(tmp_path / "copy")
    assert tokenizer_digest(lm) == tokenizer_digest(recording_lm(load_tokenizer(str(tmp_path / "copy"))))
    grown = load_tokenizer(str(tmp_path / "copy"))
    grown.add_tokens(["zyzzyva"])
    assert tokenizer_digest(recording_lm(grown)) != tokenizer_digest(lm)
    with_bos = recording_lm(world)
    with_bos.add_bos_token = not lm.add_bos_token
    assert tokenizer_digest(with_bos) != tokenizer_digest(lm)
    assert tokenizer_digest(recording_lm(load_tokenizer("tiny-llama-random"))) != tokenizer_digest(lm)


class SlowTokenizer:
    """A tokenizer without a `backend_tokenizer` (a "slow" one): its vocabulary is its state."""

    def __init__(self, vocab: dict, special: dict | None = None):
        self.vocab, self.special_tokens_map = vocab, special or {"bos_token": "<s>"}

    def get_vocab(self) -> dict:
        return dict(self.vocab)


class OtherSlowTokenizer(SlowTokenizer):
    """Another class with the same state: another tokenizer (a class can add or strip tokens around the vocabulary)."""


def stand_in(tokenizer, add_bos_token=False, prefix_token_id=1, backend="causal"):
    return SimpleNamespace(tokenizer=tokenizer, add_bos_token=add_bos_token, prefix_token_id=prefix_token_id,
                           backend=backend)


def test_the_tokenizer_digest_reads_a_fast_tokenizers_whole_state_and_a_slow_ones_vocabulary(tmp_path):
    """A fast tokenizer whose tokenizer.json differs only in its normalizer (lower-casing: the same vocabulary,
    other tokens for "Hello") has another digest; a slow one is its vocabulary, in any order, its class and its
    special tokens; each of HFLM's settings around it counts."""
    world = load_tokenizer("tiny-llama")
    world.save_pretrained(tmp_path / "lower")
    spec = json.loads((tmp_path / "lower" / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Lowercase"}
    (tmp_path / "lower" / "tokenizer.json").write_text(json.dumps(spec))
    lower = load_tokenizer(str(tmp_path / "lower"))
    assert lower.get_vocab() == world.get_vocab() and lower("Hello").input_ids != world("Hello").input_ids
    assert tokenizer_digest(recording_lm(lower)) != tokenizer_digest(recording_lm(world))

    vocab = {"a": 0, "b": 1, "<s>": 2}
    digest = tokenizer_digest(stand_in(SlowTokenizer(vocab)))
    assert tokenizer_digest(stand_in(SlowTokenizer(dict(reversed(vocab.items()))))) == digest
    for other in (stand_in(SlowTokenizer({**vocab, "c": 3})), stand_in(SlowTokenizer({"a": 1, "b": 0, "<s>": 2})),
                  stand_in(OtherSlowTokenizer(vocab)), stand_in(SlowTokenizer(vocab, {"bos_token": "a"})),
                  stand_in(SlowTokenizer(vocab), add_bos_token=True), stand_in(SlowTokenizer(vocab), prefix_token_id=2),
                  stand_in(SlowTokenizer(vocab), backend="seq2seq")):
        assert tokenizer_digest(other) != digest


KEY_FIELDS = """
import json
from lm_eval.tasks import get_task_dict
from taylor_tune.config import ZERO_SHOT_TASKS
from taylor_tune.evaluation.requests import PassRequests
from taylor_tune.evaluation.zero_shot import task_source
from taylor_tune.sources.models import load_tokenizer
from tests.evaluation.test_requests import recording_lm

requests = PassRequests(recording_lm(load_tokenizer("tiny-llama")))
out = {}
for name in ZERO_SHOT_TASKS:
    source, manager = task_source(name, "world")
    (task,) = get_task_dict([source], manager).values()
    out[name] = requests.fields(task, 5)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_every_tasks_key_is_the_same_in_another_process():
    """A sweep's trials run in separate processes: the key must hold nothing a process makes up (a function's repr
    holds its address: WinoGrande's and HellaSwag's fewshot_config put two trials of one model in two entries, which
    `make demo` showed). Two fresh processes (each its own hash seed) give the same fields for each of the seven tasks,
    and the tasks' keys all differ."""
    import subprocess
    import sys

    runs = [subprocess.run([sys.executable, "-c", KEY_FIELDS], capture_output=True, text=True, timeout=300,
                           cwd=Path(__file__).resolve().parents[2], check=True) for _ in range(2)]
    first, second = (json.loads(run.stdout.strip().splitlines()[-1]) for run in runs)
    assert first == second
    assert len({json.dumps(fields, sort_keys=True) for fields in first.values()}) == 7


def _ask(root: str) -> tuple[list, bool]:
    def build():
        with open(Path(root) / "builds", "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)
        return [[0, 1, "loglikelihood", 1, "a", " b", [1], [2]]]

    return RequestCache(root).get_or_build({"task": "t", "limit": 3}, build, lambda rows: rows)


@pytest.mark.slow  # two processes that import lm-eval
def test_two_processes_asking_at_once_build_once_and_both_get_the_requests(tmp_path):
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        answers = list(pool.map(_ask, [str(tmp_path)] * 2))
    assert sorted(built for _, built in answers) == [False, True]
    assert answers[0][0] == answers[1][0] == [[0, 1, "loglikelihood", 1, "a", " b", [1], [2]]]
    assert len((tmp_path / "builds").read_text().split()) == 1


def test_an_entry_that_does_not_read_back_is_built_again(tmp_path, caplog):
    cache, fields = RequestCache(tmp_path), {"task": "t", "limit": 3}
    rows = [[0, 1, "loglikelihood", 1, "a", " b", [1], [2]]]
    assert cache.get_or_build(fields, lambda: rows, lambda r: r) == (rows, True)
    (entry,) = tmp_path.glob("*.json")
    written = entry.read_text()
    assert read_entry(written, fields, "rows") == rows
    assert cache.get_or_build(fields, lambda: pytest.fail("built again"), lambda r: r) == (rows, False)
    edited = written.replace('" b"', '" c"')  # the payload changed, its checksum not
    for damage in (written[:20], written[:-3], edited, entry_text({"task": "u"}, "rows", rows), "[]",
                   json.dumps({"fields": fields, "rows": rows})):  # the format before checksums
        entry.write_text(damage)
        assert cache.get_or_build(fields, lambda: rows, lambda r: r) == (rows, True)
        assert entry.read_text() == written
    # rows the reader cannot take (a document that is not there) are built again too
    entry.write_text(entry_text(fields, "rows", [[99]]))
    read = lambda r: [{0: "doc"}[row[0]] for row in r]
    assert cache.get_or_build(fields, lambda: [[0]], read) == (["doc"], True)
    assert "is refused" in caplog.text and "does not match its checksum" in caplog.text


def test_a_refused_entry_says_which_check_it_failed():
    fields, rows = {"task": "t", "limit": 3}, [[0, 1, "loglikelihood", 1, "a", " b", [1], [2]]]
    written = entry_text(fields, "rows", rows)
    for other in (entry_text({"task": "u"}, "rows", rows), entry_text(fields, "other part", rows)):
        with pytest.raises(ValueError, match=r"^the entry is another one's \(its fields differ\)$"):
            read_entry(other, fields, "rows")
    with pytest.raises(ValueError, match=r"^its payload does not match its checksum \(cut short or changed\)$"):
        read_entry(written.replace('" b"', '" c"'), fields, "rows")


@pytest.fixture(scope="module")
def piqa():
    """The world's PIQA task (multiple choice, two choices per document), built by lm-eval itself."""
    from lm_eval.tasks import get_task_dict

    source, manager = zero_shot_module.task_source("piqa", "world")
    (task,) = get_task_dict([source], manager).values()
    return task


def lm_eval_build(task, limit):
    """What a plain pass builds: lm-eval's own `build_all_requests`, not patched here."""
    def build():
        task.build_all_requests(limit=limit)
        return task.instances
    return build


def what_lm_eval_hands_the_scorer(lm, instances) -> dict:
    """The reference: HFLM's own `loglikelihood` over the instances, the scorer's input recorded."""
    lm.seen = []
    lm.loglikelihood(instances, disable_tqdm=True)
    return as_lists({strings: (context, continuation) for strings, context, continuation in lm.seen})


def as_lists(encoded: dict) -> dict:
    """(context, continuation) tokens as lists, whichever sequence type holds them."""
    return {strings: (list(context), list(continuation)) for strings, (context, continuation) in encoded.items()}


def described(instances) -> list:
    return [(i.request_type, i.doc, i.arguments, i.idx, i.metadata) for i in instances]


def test_a_pass_hands_the_scorer_lm_evals_own_tokens_built_or_read_back(piqa, tmp_path):
    """Without a cache the pass returns lm-eval's instances and gives the scorer, for each (context, continuation),
    the tokens HFLM's own loglikelihood computes; with a cache the first pass builds and stores them and the second
    builds nothing (lm-eval is not called) and hands the scorer the same instances and tokens. Another limit builds
    its own; the tokens are dropped when the pass's scoring ends."""
    lm = recording_lm(load_tokenizer("tiny-llama"))
    reference_instances = lm_eval_build(piqa, 4)()
    reference = what_lm_eval_hands_the_scorer(lm, reference_instances)
    assert len(reference) == len(reference_instances) == 8  # 4 documents × 2 choices

    plain = PassRequests(lm)
    with plain.scoring():
        instances = plain(piqa, 4, lm_eval_build(piqa, 4))
        assert as_lists(lm.encoded) == reference
    assert described(instances) == described(reference_instances) and plain.built == 1
    assert lm.encoded is None and plain.seconds > 0
    with plain.scoring():
        plain(piqa, 2, lm_eval_build(piqa, 2))
    assert plain.built == 2  # a pass counts every task lm-eval built

    cache, passes = RequestCache(tmp_path), []
    for build in (lm_eval_build(piqa, 4), lambda: pytest.fail("lm-eval built the requests again")):
        requests = PassRequests(lm, cache)
        with requests.scoring():
            instances = requests(piqa, 4, build)
            passes.append((requests.built, described(instances), dict(lm.encoded), requests.seconds))
    assert [built for built, *_ in passes] == [1, 0]
    for _, instances, encoded, seconds in passes:
        assert instances == described(reference_instances) and seconds > 0
        assert as_lists(encoded) == reference
    assert len(list(tmp_path.glob("*.json"))) == 1

    # one pass over two tasks that are not stored yet builds both; its time is within the wall time around it
    other, start = PassRequests(lm, cache), time.perf_counter()
    with other.scoring():
        assert len(other(piqa, 3, lm_eval_build(piqa, 3))) == 6 and len(other(piqa, 2, lm_eval_build(piqa, 2))) == 4
    assert other.built == 2 and 0 < other.seconds <= time.perf_counter() - start
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_the_key_holds_each_field_a_passs_requests_depend_on(piqa):
    """The key's fields: the task's name, its documents within the limit, its definition, lm-eval's version, the
    tokenizer's digest, the limit and the scorer. Each differs when what it names differs, and nothing else does."""
    from importlib.metadata import version

    from taylor_tune.compat.lm_eval import task_definition, task_documents
    from taylor_tune.jsonio import digest

    lm = recording_lm(load_tokenizer("tiny-llama"))
    requests = PassRequests(lm)
    fields = requests.fields(piqa, 4)
    assert fields == {"task": "piqa_offline", "docs": digest(list(task_documents(piqa, 4))),
                      "definition": digest(task_definition(piqa)), "lm_eval": version("lm_eval"),
                      "tokenizer": tokenizer_digest(lm), "limit": 4, "scorer": "prefix"}
    assert requests.fields(piqa, 4, dict(task_documents(piqa, 4))) == fields
    assert requests.fields(piqa, 3)["docs"] != fields["docs"]
    assert PassRequests(recording_lm(load_tokenizer("tiny-llama-random"))).fields(piqa, 4)["tokenizer"] \
        != fields["tokenizer"]
    lm.scorer = "hflm"
    assert PassRequests(lm).fields(piqa, 4) == {**fields, "scorer": "hflm"}
    # a stock HFLM a notebook hands zero_shot names no scorer: its key says so
    from lm_eval.models.huggingface import HFLM

    stock = HFLM(pretrained=tiny("tiny-llama-random"), tokenizer=load_tokenizer("tiny-llama"), device="cpu")
    assert not hasattr(stock, "scorer") and PassRequests(stock).fields(piqa, 4) == {**fields, "scorer": None}


def stored_piqa_entry(piqa, folder):
    """A pass over PIQA's first four documents with a request cache in `folder`: (lm, cache, the pass, its entry,
    the entry's fields, its rows as stored)."""
    lm = recording_lm(load_tokenizer("tiny-llama"))
    cache = RequestCache(folder)
    first = PassRequests(lm, cache)
    with first.scoring():
        first(piqa, 4, lm_eval_build(piqa, 4))
    (entry,) = folder.glob("*.json")
    fields = first.fields(piqa, 4)
    return lm, cache, first, entry, fields, read_entry(entry.read_text(), fields, "rows")


def test_stored_tokens_that_the_tokenizer_does_not_give_are_refused_and_built_again(piqa, tmp_path, monkeypatch,
                                                                                     caplog):
    """Every request tokenized again: a stored row whose tokens are not the tokenizer's, with a valid checksum, is
    refused naming its document and request, and the pass builds again."""
    from taylor_tune.compat.lm_eval import task_documents
    from taylor_tune.jsonio import entry_text

    lm, cache, first, entry, fields, rows = stored_piqa_entry(piqa, tmp_path)
    docs = dict(task_documents(piqa, 4))
    for k, part in ((5, 6), (2, 7)):  # a context's, then a continuation's tokens
        bad = json.loads(json.dumps(rows))
        bad[k][part] = bad[k][part] + [bad[k][part][-1]]
        doc_id, idx = bad[k][0], bad[k][1]
        message = rf"^piqa_offline: document {doc_id}'s request {idx} holds other tokens than the tokenizer gives$"
        with first.scoring(), pytest.raises(ValueError, match=message):
            first._rows_to_instances(piqa, docs, bad)
        entry.write_text(entry_text(fields, "rows", bad))
        again = PassRequests(lm, cache)
        with again.scoring():
            again(piqa, 4, lm_eval_build(piqa, 4))
        assert again.built == 1 and read_entry(entry.read_text(), fields, "rows") == rows
    assert "holds other tokens" in caplog.text


def test_an_entry_whose_requests_hold_other_documents_contexts_is_refused_and_built_again(piqa, tmp_path, caplog):
    """Issue 80: each PIQA row given the next document's context (its tokens too, so that they are the tokenizer's),
    the entry's checksum recomputed: refused naming the document, and the pass builds lm-eval's own requests again;
    before, the rotated entry was scored (acc_piqa 0.475 instead of 1.0)."""
    from taylor_tune.jsonio import entry_text

    lm, cache, first, entry, fields, rows = stored_piqa_entry(piqa, tmp_path)
    doc_ids = sorted({row[0] for row in rows})
    context = {row[0]: (row[4], row[6]) for row in rows}  # each document's context and its tokens
    rotated = [[*row[:4], context[doc_ids[(doc_ids.index(row[0]) + 1) % len(doc_ids)]][0], row[5],
                context[doc_ids[(doc_ids.index(row[0]) + 1) % len(doc_ids)]][1], row[7]] for row in rows]
    assert rotated != rows
    entry.write_text(entry_text(fields, "rows", rotated))  # a valid checksum: only the meaning is wrong
    again = PassRequests(lm, cache)
    with again.scoring():
        again(piqa, 4, lm_eval_build(piqa, 4))
    assert again.built == 1 and read_entry(entry.read_text(), fields, "rows") == rows
    assert f"piqa_offline: document {rows[0][0]}'s request 0 holds another text than its document's" in caplog.text


def test_checked_rows_take_every_request_of_the_pass_and_nothing_else(piqa):
    """The rows lm-eval's requests give pass; each way a stored list can differ from a pass's requests is refused
    with the task's name and what differs: not a list, a row of another shape or type, a document missing or
    foreign, a choice missing or twice (a multiple-choice task has as many as the document's choices), and for any
    other task requests not numbered 0..k-1."""
    from taylor_tune.compat.lm_eval import task_documents
    from taylor_tune.evaluation.requests import checked_rows

    lm = recording_lm(load_tokenizer("tiny-llama"))
    docs = dict(task_documents(piqa, 4))
    rows = PassRequests(lm)._rows(lm_eval_build(piqa, 4)())
    assert checked_rows(piqa, docs, rows) is rows
    first_doc = rows[0][0]

    def refused(bad, match, task=piqa):
        with pytest.raises(ValueError, match=match):
            checked_rows(task, docs, bad)

    refused({"rows": rows}, r"^piqa_offline: the entry holds no list of requests$")
    shape = (r"^piqa_offline: a request row is not "
             r"\(doc_id, idx, type, repeats, context, continuation, tokens, tokens\)$")
    for k, value in ((0, True), (0, "0"), (1, 1.0), (2, 1), (3, None), (4, ["a"]), (5, 5), (6, "1 2"), (7, 3)):
        bad = [list(r) for r in rows]
        bad[1][k] = value
        refused(bad, shape)
    for extra in ([], [0]):
        bad = [list(r) for r in rows]
        bad[2] = bad[2][:7] if not extra else bad[2] + extra
        refused(bad, shape)
    for k, token in ((6, 1.5), (7, "7"), (7, None)):
        bad = [list(r) for r in rows]
        bad[3][k] = bad[3][k] + [token]
        refused(bad, shape)
    refused([r for r in rows if r[0] != first_doc],
            rf"^piqa_offline: the entry's requests miss documents \[{first_doc}\] / name unknown ones \[\]$")
    refused(rows + [[99, 0, *rows[0][2:]]],
            r"^piqa_offline: the entry's requests miss documents \[\] / name unknown ones \[99\]$")
    refused([r for r in rows if (r[0], r[1]) != (first_doc, 1)],
            rf"^piqa_offline: document {first_doc} has requests \[0\], expected 0\.\.1$")
    refused(rows + [list(rows[0])], rf"^piqa_offline: document {first_doc} has requests \[0, 0, 1\], expected 0\.\.1$")
    # a task that is not multiple choice: any count, numbered from 0
    generative = SimpleNamespace(config=SimpleNamespace(task="gen"), OUTPUT_TYPE="loglikelihood",
                                 doc_to_choice=lambda doc: pytest.fail("not a multiple-choice task"))
    single = [r for r in rows if r[1] == 0]
    assert checked_rows(generative, docs, single) is single
    assert checked_rows(generative, docs, rows) is rows
    refused([r for r in rows if (r[0], r[1]) != (first_doc, 0)],
            rf"^gen: document {first_doc} has requests \[1\], expected 0\.\.0$", generative)


def test_a_passs_seconds_add_up_the_time_of_each_task(piqa, tmp_path, monkeypatch):
    """Each task's time is the clock's reading after it less the one before; a pass adds them (a clock that jumps:
    3 s for the first task, built, and 5 s for the second, read back)."""
    from taylor_tune.evaluation import requests as requests_module

    lm, cache = recording_lm(load_tokenizer("tiny-llama")), RequestCache(tmp_path)
    first = PassRequests(lm, cache)
    with first.scoring():
        first(piqa, 2, lm_eval_build(piqa, 2))
    clock = iter([100.0, 103.0, 200.0, 205.0])
    monkeypatch.setattr(requests_module, "time", SimpleNamespace(perf_counter=clock.__next__))
    timed = PassRequests(lm, cache)
    with timed.scoring():
        timed(piqa, 3, lm_eval_build(piqa, 3))
        timed(piqa, 2, lambda: pytest.fail("stored: not built again"))
    assert (timed.seconds, timed.built) == (8.0, 1)


def test_listed_documents_are_the_documents_lm_eval_iterates_and_later_reads_skip_datasets(monkeypatch):
    """Each task's documents held as a list equal what lm-eval's own `eval_docs` iterates (datasets' row formatting,
    HellaSwag's process_docs), in order; afterwards a read of `eval_docs` is the list, no formatting of a row."""
    import datasets.formatting.formatting as formatting
    from lm_eval.tasks import get_task_dict

    from taylor_tune.compat.lm_eval import listed_documents, task_documents
    from taylor_tune.config import ZERO_SHOT_TASKS
    from taylor_tune.evaluation.zero_shot import task_source

    for name in ZERO_SHOT_TASKS:
        source, manager = task_source(name, "world")
        (task,) = get_task_dict([source], manager).values()
        own = list(task.eval_docs)
        listed_documents(task)
        formatted = []
        monkeypatch.setattr(formatting, "format_table", lambda *a, **k: formatted.append(1))
        assert task.eval_docs == own and len(own) > 0, name
        assert task_documents(task, 5) == list(enumerate(own[:5])) and not formatted, name
        monkeypatch.undo()


def test_the_batched_encoding_gives_lm_evals_tokens_and_falls_back_when_a_batch_differs(piqa, monkeypatch):
    """`compat.lm_eval.encode_requests` batches the tokenizer's calls (`batched_encode`): the same tokens as lm-eval's
    own one-at-a-time tokenization of every request of the pass; and where a batch would answer otherwise than the
    tokenizer one text at a time (planted), every text is encoded one at a time, as before."""
    from lm_eval.api.model import TemplateLM

    from taylor_tune.compat import lm_eval as compat
    from taylor_tune.compat.lm_eval import encode_requests

    lm = recording_lm(load_tokenizer("tiny-llama"))
    instances = lm_eval_build(piqa, 12)()
    recorded = []
    lm._loglikelihood_tokens = lambda requests, **_: recorded.extend(requests) or []
    TemplateLM.loglikelihood(lm, instances, disable_tqdm=True)  # lm-eval's own, no batching
    del lm._loglikelihood_tokens
    own = [(list(c), list(t)) for _, c, t in recorded]
    assert [(list(c), list(t)) for c, t in encode_requests(lm, instances)] == own and len(own) > 12
    assert "encode" not in vars(lm.tokenizer)  # put back

    real_call = type(lm.tokenizer).__call__
    monkeypatch.setattr(type(lm.tokenizer), "__call__", lambda self, texts, **kw: {
        "input_ids": [ids[:-1] or ids for ids in real_call(self, texts, **kw)["input_ids"]]})
    monkeypatch.setattr(compat, "BATCH_CHECKED", 0)  # nothing checked: the planted batch's answers are used
    assert [(list(c), list(t)) for c, t in encode_requests(lm, instances)] != own
    monkeypatch.setattr(compat, "BATCH_CHECKED", 32)  # as shipped: the sample finds the difference
    assert [(list(c), list(t)) for c, t in encode_requests(lm, instances)] == own
