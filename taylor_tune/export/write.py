"""`export` itself: the output checked before any work, the trial chosen and rebuilt in a scratch folder beside the
output, and the folder moved into place only when it is complete (a refused or failed export writes nothing)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from taylor_tune.config import layout_name
from taylor_tune.export.card import model_card
from taylor_tune.export.choose import ExportError, choose
from taylor_tune.export.rebuild import rebuild
from taylor_tune.export.to_decilm import check_trial, converter_problem, write_decilm
from taylor_tune.export.to_gguf import check_file_type, check_gguf, gguf_name, write_gguf
from taylor_tune.jsonio import write_json
from taylor_tune.pruning.apply import save_pruned
from taylor_tune.sources.data import PRUNED_MANIFEST
from taylor_tune.storage.location import shown


def check_output(output: Path, sweep: str) -> None:
    """A new folder, outside the sweep, under a writable folder; ExportError naming --output otherwise."""
    if output.is_symlink() or output.exists():  # a dangling link too: the export would be written through it
        what = "is a link" if output.is_symlink() else "exists"
        raise ExportError(f"--output {output} {what}; give a new folder (an export never writes over one)")
    dangling = next((p for p in output.parents if p.is_symlink() and not p.exists()), None)
    if dangling is not None:  # the folders above --output would be made through it, where it points
        raise ExportError(f"--output {output}: {dangling} is a link to nothing ({os.readlink(dangling)}); give a "
                          "folder whose parents exist or can be made")
    if output.resolve().is_relative_to(Path(sweep).resolve()):
        raise ExportError(f"--output {output} lies inside the sweep {sweep}; give a folder outside it")
    parent = next(p for p in output.resolve().parents if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ExportError(f"--output {output}: {parent} is not a writable folder")


FORMATS = ("hf", "decilm")


def export(sweep: str, output: str | Path, *, model: str | None = None, trial: str | None = None,
           rank: int | None = None, constraints: tuple[str, ...] = (), gguf: str | None = None,
           trust_remote_code: bool = False, format: str = "hf") -> Path:
    """Rebuild the chosen trial's model and write it to `output` with its card (and its GGUF when `gguf` names a
    file type). `format`: "hf" (transformers' folder: stock classes where every layer has one shape, taylor_tune's
    pruned classes otherwise) or "decilm" (`DeciLMForCausalLM` with `block_configs`, which vLLM, TensorRT-LLM,
    SGLang and llama.cpp's converter read: `export.to_decilm`). `trust_remote_code`: the user's word that the trial's
    model may run its own code; never read from the sweep."""
    output = Path(output)
    check_output(output, sweep)
    if format not in FORMATS:
        raise ExportError(f"--format {format!r}: the formats written are {', '.join(FORMATS)}")
    if gguf is not None:
        check_file_type(gguf)  # before any work
    chosen = choose(sweep, model=model, trial=trial, rank=rank, constraints=tuple(constraints))
    if format == "decilm":
        check_trial(chosen, trust_remote_code=trust_remote_code)
    command = (f"taylor-tune export {shown(sweep)} --model {chosen.model} --trial {chosen.trial_id} "
               f"--output {shown(output)}"
               + (f" --gguf {gguf}" if gguf else "") + (f" --format {format}" if format != "hf" else ""))
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        _write(sweep, chosen, output, command, gguf, trust_remote_code, format)
    except Exception as error:  # the writers' own types (safetensors', gguf's) carry a full disk as text, not errno
        if not _disk_full(error):
            raise
        free = shutil.disk_usage(output.parent).free / 2**20
        raise ExportError(f"--output {output}: no space left on its disk ({free:.1f} MB free); nothing written: free "
                          "space there or choose another folder") from None
    return output


def _normal_modes(folder: Path) -> None:
    """Every file of the folder readable as a file this user writes is (0666 less the umask; folders 0777 less it):
    the writers (safetensors among them) and the scratch folder leave some 0600, though an export is made to be
    shared."""
    umask = os.umask(0)
    os.umask(umask)
    for path in (folder, *folder.rglob("*")):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _disk_full(error: BaseException) -> bool:
    """Whether a writer failed for want of room: an errno of a full disk or quota, or the text its own type carries
    (safetensors' Rust "os error 28"; numpy's `tofile`, which the GGUF writer uses, reports a short write only as
    "N requested and M written", with no errno)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    return "No space left on device" in text or "os error 28" in text or bool(_SHORT_WRITE.search(text))


_SHORT_WRITE = re.compile(r"\b\d+ requested and \d+ written\b")


def _write(sweep: str, chosen, output: Path, command: str, gguf: str | None, trust_remote_code: bool,
           format: str = "hf") -> None:
    """The model folder and its card built in a scratch folder beside `output`, then moved into place whole."""
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.export-") as scratch:
        rebuilt = rebuild(chosen, Path(scratch) / "work", trust_remote_code=trust_remote_code)
        converter = None
        if format == "decilm":
            folder, folder_format = write_decilm(rebuilt.model, rebuilt.tokenizer, Path(scratch) / "model"), "decilm"
            converter = converter_problem(folder)
        else:
            folder = save_pruned(rebuilt.model, Path(scratch) / "model", rebuilt.tokenizer,
                                 source_model=rebuilt.trial.prune.model)
            folder_format = "stock" if json.loads((folder / PRUNED_MANIFEST).read_text())["uniform"] else "pruned"
        prune = rebuilt.trial.prune
        layout = layout_name(prune.method, prune.uniform, prune.align, prune.servable)
        record = rebuilt.trial.record()
        written = None
        if gguf is not None:
            path = folder / gguf_name(gguf)
            written = {"file": path.name} | write_gguf(rebuilt.model, rebuilt.tokenizer, path, file_type=gguf,
                                                       name=f"{rebuilt.trial.prune.model} pruned ({chosen.trial_id})")
            written["check"] = check_gguf(path, rebuilt.model, rebuilt.tokenizer, gguf)
        pruning = rebuilt.run.pruning
        experts = pruning.plan.experts_kept(pruning.layout) if pruning.plan.experts_removed else None
        (folder / "README.md").write_text(model_card(chosen, record, rebuilt.checks, layout=layout,
                                                     folder_format=folder_format, command=command, gguf=written,
                                                     converter=converter, experts=experts))
        write_json(folder / "export.json", {"sweep": str(sweep), "trial_id": chosen.trial_id,
                                            "trial_folder": chosen.folder, "why": chosen.why, "layout": layout,
                                            "format": folder_format,
                                            "checks": rebuilt.checks, "gguf": written, "config": record,
                                            "command": command, "llama_cpp_converter": converter})
        _normal_modes(folder)
        try:
            os.replace(folder, output)
        except OSError:
            if not (output.is_symlink() or output.exists()):
                raise
            raise ExportError(f"--output {output} was written by another export meanwhile; this one wrote nothing "
                              "(give each export its own folder)") from None
