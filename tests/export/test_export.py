"""`taylor-tune export` (issue 65, builds 1 and 4; must-shows 1 and 3) on a sweep folder as Tune leaves it, whose
trials ran here without Ray (`run_trial`, the trainable's own function, with the sweep's importance cache): free,
uniform and depth layouts, a recovered trial, an unfinished one. The exported folders are checked against models built
independently (`prune` without the cache, loaded back), not against the export's own rebuild."""

import json
import subprocess
import sys

import pytest
import torch
import yaml

from taylor_tune.config import Evaluation, PruneConfig, RecoverySpec
from taylor_tune.export import export
from taylor_tune.export.choose import ExportError
from taylor_tune.jsonio import json_safe
from taylor_tune.sources import world
from taylor_tune.sweep.trial import TrialConfig, run_trial

pytestmark = pytest.mark.slow  # seven tiny trials, then a rebuild per export

EVALUATION = Evaluation(tasks="piqa", task_data="world", ppl="world", ppl_max_windows=4, batch_size=16,
                        fidelities=[8], speed=None)
RECOVERY = RecoverySpec(data="world", steps=4, lr=2e-3, warmup_steps=1, micro_batch_size=4, seq_len=32,
                        lora_dropout=0.0)
TRIALS = {  # trial id -> (PruneConfig fields, recovery)
    "free": ({"method": "taylor"}, None),
    "uniform": ({"method": "taylor", "uniform": True}, None),
    "depth": ({"method": "depth", "depth_criterion": "angular"}, None),
    "recovered": ({"method": "taylor"}, RECOVERY),
}


def trial_config(fields: dict, recovery, cache: str | None) -> TrialConfig:
    prune = {"model": "tiny-llama", "sparsity": 0.25, "seq_len": 32, "num_samples": 8, "calibration": "world",
             "device": "cpu", "dtype": "float32"} | fields
    return TrialConfig(prune=PruneConfig(**prune), evaluation=EVALUATION, sample_counts=(8,), cache_dir=cache,
                       recovery=recovery)


def tune_params(trial: TrialConfig) -> dict:
    """The params.json Tune writes for the point that runs `trial` (the model and seed, the rest as fixed settings)."""
    record = trial.record()
    prune = {k: v for k, v in record["prune"].items() if k not in ("model", "seed")}
    return {"model": trial.prune.model, "seed": trial.prune.seed,
            "fixed": {"prune": prune, "evaluation": record["evaluation"], "sample_counts": list(trial.sample_counts),
                      "cache_dir": trial.cache_dir, "recovery": record.get("recovery")}}


def tune_folder(sweep, name: str, index: int, trial: TrialConfig | None = None):
    """A trial folder named as Tune names a sweep's (sweep_trainable_<experiment>_<index>_<index>_<params>; the
    trial id is `<name>_<index>`, here `ids[name]`), with its params.json."""
    folder = sweep / f"sweep_trainable_{name}_{index:05d}_{index}_x"
    folder.mkdir(parents=True)
    params = {"fixed": {"evaluation": {"fidelities": [8]}}} if trial is None else tune_params(trial)
    (folder / "params.json").write_text(json.dumps(params))
    return folder


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """name -> its trial's reported metrics; `ids`: name -> trial id; `path`: the sweep's folder."""
    root = tmp_path_factory.mktemp("sweeps") / "exp"
    cache, metrics = str(root / "importance_cache"), {}
    calibration = root.parent / "calibration.txt"  # a calibration file of the user's own, read again by a rebuild
    calibration.write_text(world.corpus_path().read_text())
    trials = TRIALS | {"owntext": ({"method": "taylor", "calibration": str(calibration)}, None)}
    ids = {name: f"{name}_{index:05d}" for index, name in enumerate([*trials, "stopped", "failed"])}
    for index, (name, (fields, recovery)) in enumerate(trials.items()):
        trial = trial_config(fields, recovery, cache)
        folder = tune_folder(root, name, index, trial)
        metrics[name] = run_trial(trial, folder)
        (folder / "result.json").write_text(json.dumps(json_safe(metrics[name])) + "\n")
    unfinished = tune_folder(root, "stopped", len(trials))  # pruned, then stopped before its evaluation
    (unfinished / "result.json").write_text(json.dumps({"model": "tiny-llama", "stage": "pruned"}) + "\n")
    failed = tune_folder(root, "failed", len(trials) + 1)  # pruned, then errored (Tune's error.txt)
    (failed / "result.json").write_text(json.dumps({"model": "tiny-llama", "stage": "pruned"}) + "\n")
    (failed / "error.txt").write_text("Failure # 1 (occurred at 2026-11-28)\nRuntimeError: CUDA error: out of memory\n")
    metrics |= {"path": root, "calibration": calibration, "ids": ids}
    return metrics


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[1, 40, 41, 72, 101, 32, 115, 99, 104, 111, 111, 108]])


@pytest.mark.parametrize("name", ["free", "uniform", "depth"])
def test_an_export_loads_as_the_trials_model_and_gives_its_perplexity(sweep, tmp_path, name):
    """The folder's logits equal a pruning of the same configuration built here without the sweep's cache (fp32,
    1e-5), and its held-out perplexity on the trial's windows is the trial's; stock layouts load in plain
    from_pretrained without remote code, the free layout through taylor_tune's pruned classes."""
    from transformers import AutoModelForCausalLM

    from taylor_tune.evaluation.evaluate import Evaluator
    from taylor_tune.pruning.prune import prune
    from taylor_tune.sources.models import load_model, load_tokenizer

    trial_id = sweep["ids"][name]
    out = export(str(sweep["path"]), tmp_path / "out", trial=trial_id)
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "transformers" and "taylor-tune" in front["tags"]
    assert f"Trial `{trial_id}`" in card and f"{sweep[name]['acc_mean']:.4f}" in card
    record = json.loads((out / "export.json").read_text())
    # its layers' shapes (one word for them everywhere: config.layout_name), and how the folder loads
    assert record["layout"] == name and record["trial_id"] == trial_id
    assert record["format"] == ("pruned" if name == "free" else "stock")
    config = trial_config(*TRIALS[name], cache=None).prune
    reference = prune(config).model
    loaded = load_model(str(out))
    assert torch.allclose(logits(loaded, IDS), logits(reference, IDS), rtol=0, atol=1e-5)
    ppl = Evaluator(loaded, load_tokenizer(str(out)), EVALUATION.spec(None), model_name="tiny-llama").perplexity().ppl
    assert ppl == pytest.approx(sweep[name]["ppl"], rel=1e-6)
    if record["format"] == "stock":
        stock = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False)
        assert torch.allclose(logits(stock, IDS), logits(reference, IDS), rtol=0, atol=1e-5)
    else:
        assert "auto_map" in json.loads((out / "config.json").read_text())  # the free layout's own classes


def test_a_recovered_trials_export_is_its_recovered_model(sweep, tmp_path):
    """The exported folder (the adapters merged) gives the trial's held-out loss after recovery to 1e-6 relative."""
    from taylor_tune.recovery.train import heldout_loss
    from taylor_tune.sources.data import resolve_text
    from taylor_tune.sources.models import load_model, load_tokenizer
    from taylor_tune.sources.recovery_data import heldout_ids

    out = export(str(sweep["path"]), tmp_path / "out", trial=sweep["ids"]["recovered"])
    loaded = load_model(str(out))
    held = heldout_ids(load_tokenizer(str(out)), resolve_text("world", "tiny-llama"), RECOVERY)
    loss = heldout_loss(loaded, held, RECOVERY.micro_batch_size)
    assert loss == pytest.approx(sweep["recovered"]["recovery_heldout_loss"], rel=1e-6)
    assert "lora-recovered" in (out / "README.md").read_text()


def test_the_default_is_the_reports_best_and_a_rank_the_next(sweep, tmp_path):
    from taylor_tune.reporting import build_report

    report = build_report(str(sweep["path"]))
    best = report.models["tiny-llama"].best["trial_id"]
    out = export(str(sweep["path"]), tmp_path / "best")
    assert json.loads((out / "export.json").read_text())["trial_id"] == best
    ids = sweep["ids"]
    ranked = sorted([*TRIALS, "owntext"], key=lambda t: (-sweep[t]["acc_mean"], sweep[t]["ppl"], ids[t]))
    assert ids[ranked[0]] == best
    second = export(str(sweep["path"]), tmp_path / "second", rank=2)
    assert json.loads((second / "export.json").read_text())["trial_id"] == ids[ranked[1]]


@pytest.mark.parametrize("edited", [("config.json",), ("config.json", "params.json"),
                                    ("config.json", "params.json", "result.json")])
def test_a_record_edited_to_a_model_with_its_own_code_runs_no_code(sweep, tmp_path, capsys, edited):
    """Issue 80: a trial's records edited to `prune.model: <a folder with an auto_map module>` and
    `trust_remote_code: true`: export imported and ran that module, then refused. Now the record must be what Tune
    ran (params.json), and trust_remote_code comes from the command alone: one line, exit 2, no marker."""
    import shutil

    from taylor_tune.cli import main

    copy = tmp_path / "sweep"
    shutil.copytree(sweep["path"], copy)
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil_model"
    evil.mkdir()
    (evil / "config.json").write_text(json.dumps({
        "model_type": "evil", "architectures": ["EvilModel"],
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}}))
    (evil / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                  "from transformers import PretrainedConfig\n"
                                  "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n")
    folder = next(copy.glob("sweep_trainable_free_*"))
    for name in edited:
        if name == "result.json":
            lines = [json.loads(line) for line in (folder / name).read_text().splitlines()]
            (folder / name).write_text("".join(json.dumps(r | {"model": str(evil)}) + "\n" for r in lines))
            continue
        record = json.loads((folder / name).read_text())
        prune = record["prune"] if name == "config.json" else record["fixed"]["prune"]
        prune["trust_remote_code"] = True
        if name == "config.json":
            prune["model"] = str(evil)
        else:
            record["model"] = str(evil)
        (folder / name).write_text(json.dumps(record))
    code = main(["export", str(copy), "--trial", sweep["ids"]["free"], "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    expected = {1: "not a finished trial (its files disagree: params.json and config.json disagree on prune.model, "
                   "prune.trust_remote_code)",
                2: "config.json is not what trial free_00000 ran (its model",
                3: "ran its model's own code (trust_remote_code); the export runs it only when you say so"}
    assert expected[len(edited)] in err, err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_an_output_that_is_a_dangling_link_or_written_by_a_second_export_at_once_is_one_line(sweep, tmp_path):
    """Issue 80: `--output` a dangling symlink, and two exports into one output at the same moment, ended in OSError
    tracebacks. Now one line and exit 2 each (the link is not written through; the first export's folder stays)."""
    import os
    import subprocess
    import sys

    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    command = [sys.executable, "-m", "taylor_tune", "export", str(sweep["path"]), "--trial", sweep["ids"]["free"]]
    proc = subprocess.run([*command, "--output", str(link)], capture_output=True, text=True)
    said = f"taylor-tune: error: --output {link} is a link; give a new folder (an export never writes over one)\n"
    assert proc.returncode == 2 and proc.stderr == said, proc.stderr
    assert not (tmp_path / "nowhere").exists()

    out = tmp_path / "out"
    both = [subprocess.Popen([*command, "--output", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}) for _ in range(2)]
    ended = sorted((p.wait(timeout=300), p.stderr.read()) for p in both)
    assert [code for code, _ in ended] == [0, 2], ended
    said = ended[1][1]
    assert said.count("\n") == 1 and "Traceback" not in said, said
    assert f"--output {out} " in said and ("was written by another export meanwhile" in said or "exists" in said)
    assert (out / "README.md").is_file() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(sweep, tmp_path):
    """Issue 80: `export` onto a full disk ended in a traceback. Now one line naming the output, exit 2, and neither
    the output nor a scratch folder left on the disk."""
    import subprocess
    import sys

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        proc = subprocess.run([sys.executable, "-m", "taylor_tune", "export", str(sweep["path"]), "--trial",
                               sweep["ids"]["free"], "--output", str(disk / "out")], capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "no space left" in proc.stderr and str(disk / "out") in proc.stderr, proc.stderr
        assert list(disk.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_gguf_the_disk_has_no_room_for_is_one_line_and_leaves_nothing(sweep, tmp_path):
    """Issue 91, case 6: a disk with room for the model's safetensors but not for its GGUF: numpy's short write
    ("N requested and M written", no errno) ended the export in a traceback, exit 1. Now one line, exit 2, nothing
    left on the disk. The disk is sized from the same export written whole: everything else and half the GGUF."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "taylor_tune", "export", str(sweep["path"]), "--trial", sweep["ids"]["free"],
               "--gguf", "f16"]
    whole = tmp_path / "whole"
    assert subprocess.run([*command, "--output", str(whole)], capture_output=True).returncode == 0
    files = [p for p in whole.rglob("*") if p.is_file()]
    gguf = (whole / "model.f16.gguf").stat().st_size
    rest = sum(-(-p.stat().st_size // 4096) * 4096 for p in files if p.name != "model.f16.gguf")
    size = rest + 16 * 4096 + gguf // 2  # the folders' own blocks, then half the GGUF
    assert gguf > 32 * 4096, gguf  # half of it is more than the slack
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        proc = subprocess.run([*command, "--output", str(disk / "out")], capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "no space left" in proc.stderr and str(disk / "out") in proc.stderr, proc.stderr
        assert list(disk.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_an_output_under_a_dangling_link_is_one_line_and_nothing_is_made_where_it_points(sweep, tmp_path, capsys):
    """Issue 91, case 6: `--output a/model` where `a` is a dangling link ended in FileExistsError, exit 1 (check_output
    looked at --output only, not its parents). Now one line naming the link, exit 2, before any work."""
    from taylor_tune.cli import main

    (tmp_path / "a").symlink_to(tmp_path / "nowhere")
    code = main(["export", str(sweep["path"]), "--trial", sweep["ids"]["free"], "--output", str(tmp_path / "a" / "m")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"--output {tmp_path / 'a' / 'm'}: {tmp_path / 'a'} is a link to nothing" in err, err
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("format", ["hf", "decilm"])
def test_an_export_is_readable_as_any_file_and_its_card_holds_no_absolute_path(sweep, tmp_path, format):
    """Issue 91, case 7: every export wrote `model.safetensors` 0600 (every other file 0644), and the card's "made
    again by" line carried the sweep and output paths as typed: absolute ones put the machine's folders into a card
    made to be published. Now every file has the mode a file this user writes gets, and the line shows the paths
    relative to the current folder, or their last two parts."""
    import os

    out = tmp_path / "deep" / "out"
    folder = export(str(sweep["path"].absolute()), out.absolute(), trial=sweep["ids"]["depth" if format == "decilm"
                                                                                 else "free"], format=format)
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in folder.rglob("*") if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes
    assert folder.stat().st_mode & 0o777 == 0o777 & ~umask
    card = (folder / "README.md").read_text()
    line = next(line for line in card.splitlines() if line.startswith("- made again by:"))
    assert str(tmp_path) not in card and str(sweep["path"].parent) not in card, line
    assert f"taylor-tune export {sweep['path'].parent.name}/exp --model " in line and "--output deep/out" in line


def test_the_model_card_shows_plain_numbers_no_machine_path_and_only_the_settings_the_method_read(sweep, tmp_path):
    """Issue 80: the card showed `np.int64(107611776)` where numbers belong, the machine's absolute trial folder, and
    settings a taylor trial never read (flap_compensation, depth_criterion, blockwise_attention)."""
    for name, read, unread in (
            ("free", {"method", "criterion", "seq_len", "num_samples"},
             {"flap_compensation", "depth_criterion", "depth_share", "blockwise_attention", "blockwise_layer_start",
              "layerwise_max_ratio", "uniform_multiple"}),
            ("depth", {"method", "depth_criterion"}, {"flap_compensation", "blockwise_attention"})):
        card = (export(str(sweep["path"]), tmp_path / name, trial=sweep["ids"][name]) / "README.md").read_text()
        assert "np." not in card and "numpy" not in card
        folder = next(sweep["path"].glob(f"sweep_trainable_{name}_*"))
        assert str(folder) not in card and f"- sweep trial folder: `exp/{folder.name}`" in card
        settings = {line.split("|")[1].strip() for line in card.split("## Configuration")[1].split("##")[0].splitlines()
                    if line.startswith("| ") and not line.startswith("| setting")}
        assert read <= settings and not settings & unread, settings
        assert f"| params_count | {int(sweep[name]['params_count'])} |" in card
        checks = card.split("checked against the trial: ")[1].split("\n")[0]
        assert f"params_count {int(sweep[name]['params_count'])} (trial: {int(sweep[name]['params_count'])})" in checks


def test_the_card_says_whether_a_free_layouts_widths_are_aligned(sweep, tmp_path):
    """Issue 83, must-show 4: a free export's card says its widths are not aligned and names the setting that aligns
    them; an aligned trial's card names its multiple; another layout's card names the layout alone."""
    from taylor_tune.export.card import layout_said

    card = (export(str(sweep["path"]), tmp_path / "free", trial=sweep["ids"]["free"]) / "README.md").read_text()
    assert "Layout: free, each layer's widths as its importance earned them, not aligned" in card
    assert "`align: 64`" in card
    assert layout_said("align 128", {"align": 128}) == "free, every kept width a multiple of 128 (`align: 128`)"
    assert layout_said("uniform", {"align": None}) == "uniform" and layout_said("depth", {}) == "depth"
    assert layout_said("servable", {"servable": True, "align": None}).startswith(
        "servable: every layer's attention kept and every MLP width a multiple of 256")


def test_a_rebuild_that_does_not_give_the_trials_numbers_is_refused_and_writes_nothing(sweep, tmp_path):
    """A setting changed in the trial's record (its calibration seed): refused before anything loads, as the record
    is no longer what Tune ran (params.json: the report flags the trial, naming both); changed in both, then the
    calibration text changed on disk: each rebuild prunes another model, its perplexity is not the trial's, and
    nothing is written."""
    import shutil

    copy = tmp_path / "sweep"
    shutil.copytree(sweep["path"], copy)
    folder = next(copy.glob("sweep_trainable_free_*"))
    record = json.loads((folder / "config.json").read_text())
    record["prune"]["seed"] = 1
    (folder / "config.json").write_text(json.dumps(record))
    with pytest.raises(ExportError, match=r"--trial free_00000: not a finished trial \(its files disagree: "
                                          r"params.json and config.json disagree on prune.seed\)"):
        export(str(copy), tmp_path / "out", trial=sweep["ids"]["free"])
    params = json.loads((folder / "params.json").read_text())
    (folder / "params.json").write_text(json.dumps(params | {"seed": 1}))
    with pytest.raises(ExportError, match=r"trial free_00000: the rebuilt model's ppl is .* the trial reported"):
        export(str(copy), tmp_path / "out", trial=sweep["ids"]["free"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]  # no output, no scratch folder left
    text = sweep["calibration"].read_text()
    try:
        sweep["calibration"].write_text("\n".join(reversed(text.splitlines())))  # the same lines, another order
        with pytest.raises(ExportError, match=r"trial owntext_00004: the rebuilt model's ppl"):
            export(str(sweep["path"]), tmp_path / "out", trial=sweep["ids"]["owntext"])
    finally:
        sweep["calibration"].write_text(text)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]
    export(str(sweep["path"]), tmp_path / "out", trial=sweep["ids"]["owntext"])  # the text as it was: as before


def test_export_with_gguf_writes_a_file_llama_cpp_reads_as_the_exported_model(sweep, tmp_path):
    """`--gguf f32` on the free trial: the folder's GGUF (architecture `deci`, per-layer widths) checked by the export
    in llama.cpp, recorded in export.json and the card; read again here against the exported folder's model."""
    from taylor_tune.export.to_gguf import gguf_logprobs, torch_logprobs
    from taylor_tune.sources.models import load_model, load_tokenizer

    run = cli(sweep["path"], "--trial", sweep["ids"]["free"], "--gguf", "f32", "--output", tmp_path / "out")
    assert run.returncode == 0, run.stderr
    out = tmp_path / "out"
    record = json.loads((out / "export.json").read_text())
    assert record["gguf"]["file"] == "model.f32.gguf" and record["gguf"]["architecture"] == "deci"
    assert record["gguf"]["check"]["checked"] and record["gguf"]["check"]["max_abs_logprob_gap"] < 1e-3
    assert record["command"].endswith("--gguf f32")
    assert "## llama.cpp" in (out / "README.md").read_text()
    assert "gguf" in yaml.safe_load((out / "README.md").read_text().split("---")[1])["tags"]
    tokens = load_tokenizer(str(out)).encode(world.heldout_path().read_text())[:64]
    gap = abs(gguf_logprobs(out / "model.f32.gguf", tokens) - torch_logprobs(load_model(str(out)), tokens))
    assert gap.max() < 1e-4


def test_without_llama_cpp_the_gguf_is_written_unchecked_and_the_export_says_so(sweep, tmp_path, capsys, monkeypatch):
    """`make demo` installs no llama-cpp-python (it builds from source: the tests' set-up has it): the export writes
    the GGUF all the same, records that it is unchecked and why, and says so in one note line."""
    import sys

    from taylor_tune.cli import main

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError, as where it is absent
    code = main(["export", str(sweep["path"]), "--trial", sweep["ids"]["free"], "--gguf", "f32",
                 "--output", str(tmp_path / "out")])
    said = capsys.readouterr().out
    assert code == 0, said
    record = json.loads((tmp_path / "out" / "export.json").read_text())
    assert record["gguf"]["check"] == {"checked": False,
                                       "why": "llama-cpp-python is not installed (pip install 'taylor-tune[gguf]')"}
    assert (tmp_path / "out" / "model.f32.gguf").stat().st_size > 0
    assert "note: model.f32.gguf is written unchecked: llama-cpp-python is not installed" in said, said


def test_export_as_decilm_writes_block_configs_a_reader_rebuilds_the_model_from(sweep, tmp_path):
    """`--format decilm` on the depth trial (every width kept: servable): `block_configs` per kept layer, read here as
    DeciLM's readers read them (query heads / n_heads_in_group, ceil256(int(2 * ffn_mult * hidden / 3))), into a
    Llama built from them with the folder's weights: the trial's model. The free trial (widths not multiples of 256)
    is refused in one line naming the servable settings, exit 2, nothing written."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from taylor_tune.export.to_decilm import readers_width
    from taylor_tune.pruning.prune import prune

    run = cli(sweep["path"], "--trial", sweep["ids"]["depth"], "--format", "decilm", "--output", tmp_path / "out")
    assert run.returncode == 0, run.stderr
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DeciLMForCausalLM"] and config["model_type"] == "nemotron-nas"
    blocks = config["block_configs"]
    assert len(blocks) == config["num_hidden_layers"]
    kv = {config["num_attention_heads"] // b["attention"]["n_heads_in_group"] for b in blocks}
    widths = {readers_width(b["ffn"]["ffn_mult"], config["hidden_size"]) for b in blocks}
    assert len(kv) == len(widths) == 1  # a depth cut: every layer as it was
    fields = {k: v for k, v in config.items() if k not in ("block_configs", "architectures", "model_type")}
    rebuilt = LlamaForCausalLM(LlamaConfig(**fields | {"num_key_value_heads": kv.pop(),
                                                       "intermediate_size": widths.pop()})).eval()
    rebuilt.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"))
    reference = prune(trial_config(*TRIALS["depth"], cache=None).prune).model
    assert torch.allclose(logits(rebuilt, IDS), logits(reference, IDS), rtol=0, atol=1e-5)
    written = json.loads((tmp_path / "out" / "export.json").read_text())
    assert written["format"] == "decilm" and written["layout"] == "depth"

    run = cli(sweep["path"], "--trial", sweep["ids"]["free"], "--format", "decilm", "--output", tmp_path / "free")
    assert run.returncode == 2 and "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert "--format decilm: not written" in run.stderr and "servable: true" in run.stderr
    assert not (tmp_path / "free").exists()


def test_a_trial_decilm_cannot_hold_is_refused_from_its_records_before_a_rebuild(sweep, tmp_path, monkeypatch):
    """The free trial's recorded plan (its pruning_summary.json) decides the refusal: no rebuild runs (minutes at
    8B); the reason is the one the rebuilt model gives, named by its layer and shape."""
    import taylor_tune.export.write as write

    def no_rebuild(*args, **kwargs):
        raise AssertionError("rebuilt before the refusal")

    monkeypatch.setattr(write, "rebuild", no_rebuild)
    with pytest.raises(ExportError, match=r"--format decilm: not written: layer \d+( lost query heads|'s MLP width)"):
        export(str(sweep["path"]), tmp_path / "free", trial=sweep["ids"]["free"], format="decilm")
    assert not (tmp_path / "free").exists()


def test_an_unknown_gguf_type_is_refused_before_any_work(sweep, tmp_path):
    run = cli(sweep["path"], "--gguf", "q4_0", "--output", tmp_path / "out")
    assert run.returncode == 2 and "Traceback" not in run.stderr and "invalid choice: 'q4_0'" in run.stderr
    from taylor_tune.export.to_gguf import GGUFError

    with pytest.raises(GGUFError, match=r"--gguf 'q4_0': the GGUF types written are f16, f32"):
        export(str(sweep["path"]), tmp_path / "out", gguf="q4_0")
    assert not (tmp_path / "out").exists()


def cli(*args):
    return subprocess.run([sys.executable, "-m", "taylor_tune", "export", *map(str, args)], capture_output=True,
                          text=True)


@pytest.mark.parametrize("case, needle", [
    ("unknown trial", "--trial 'nope': no such trial of tiny-llama"),
    ("unfinished trial", "--trial stopped_00005: not a finished trial (incomplete"),
    ("errored trial", "--trial failed_00006: not a finished trial (errored: RuntimeError: CUDA error: out of memory)"),
    ("not a sweep", "not a Tune experiment folder"),
    ("output exists", "exists; give a new folder"),
    ("output inside the sweep", "lies inside the sweep"),
    ("no trial meets the constraint", "no finished trial of tiny-llama in"),
    ("rank beyond the trials", "--rank 9: only 5 finished trial(s)"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(sweep, tmp_path, capsys, case, needle):
    """`main` in this process, the body of the entry point (which the test above runs as a user would)."""
    from taylor_tune.cli import main

    path, out = sweep["path"], tmp_path / "out"
    (tmp_path / "plain").mkdir()  # a folder, but not a sweep's
    args = {"unknown trial": [path, "--trial", "nope", "--output", out],
            "unfinished trial": [path, "--trial", sweep["ids"]["stopped"], "--output", out],
            "errored trial": [path, "--trial", sweep["ids"]["failed"], "--output", out],
            "not a sweep": [tmp_path / "plain", "--output", out],
            "output exists": [path, "--output", tmp_path],
            "output inside the sweep": [path, "--output", path / "exported"],
            "no trial meets the constraint": [path, "--constraint", "acc_mean>=2", "--output", out],
            "rank beyond the trials": [path, "--rank", "9", "--output", out]}[case]
    before = sorted(p.name for p in path.iterdir())
    code, err = main(["export", *map(str, args)]), capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err
    assert not out.exists() and sorted(p.name for p in path.iterdir()) == before
