"""Issue 83, build 3: `export --format decilm` read by an independent implementation. llama.cpp's own converter
(`convert_hf_to_gguf.py` with its `conversion/deci.py`), taken from the pinned llama-cpp-python source distribution
and not from project code, converts the exported folder; llama.cpp then scores every next token as the pruned model
does. DeciLM's converter takes Llama 3's vocabulary (its 128256 tokens), which the same distribution ships as
`models/ggml-vocab-llama-bpe.gguf`: the tiny model here is built on it."""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from taylor_tune.export.choose import ExportError
from taylor_tune.export.to_decilm import FFN_TILE, ffn_mult, readers_width, write_decilm
from taylor_tune.export.to_gguf import GGUFError, gguf_logprobs, torch_logprobs
from taylor_tune.pruning.apply import apply_plan
from taylor_tune.pruning.plan import PrunePlan
from taylor_tune.sources.assets import file_sha256, home
from tests.helpers import llama

SDIST = ("llama-cpp-python", "0.3.36", "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/", "models/ggml-vocab-llama-bpe.gguf")
LLAMA3_VOCAB = 128256


def converter() -> Path:
    """llama.cpp's converter out of the pinned sdist (pip download, sha256 checked), cached in the asset home."""
    package, version, sha256 = SDIST
    target = home() / f"{package}-{version}-converter"
    if (target / "ok").is_file():
        return target
    with tempfile.TemporaryDirectory() as scratch:
        run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                              "--quiet", "-d", scratch, f"{package}=={version}"], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        (archive,) = Path(scratch).glob("*.tar.gz")
        assert file_sha256(archive) == sha256
        prefix = f"{package.replace('-', '_')}-{version}/vendor/llama.cpp/"
        with tarfile.open(archive) as tar:
            wanted = [m for m in tar.getmembers() if m.isfile() and any(
                m.name.startswith(prefix + member) if member.endswith("/") else m.name == prefix + member
                for member in MEMBERS)]
            tar.extractall(scratch, members=wanted, filter="data")
        shutil.rmtree(target, ignore_errors=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(Path(scratch) / prefix, target)
    (target / "ok").write_text(sha256 + "\n")
    return target


def llama3_tokenizer(vendor: Path, into: Path):
    """Llama 3's tokenizer rebuilt from llama.cpp's vocabulary file: BOS added as Llama 3's own adds it (so llama.cpp
    recognises its pre-tokenizer), the one token transformers' GGUF reader appends past the 128256 dropped."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vendor / "models", gguf_file="ggml-vocab-llama-bpe.gguf",
                                              add_bos_token=True)
    tokenizer.save_pretrained(into)
    spec = json.loads((into / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < LLAMA3_VOCAB]
    spec["model"]["vocab"] = {k: v for k, v in spec["model"]["vocab"].items() if v < LLAMA3_VOCAB}
    (into / "tokenizer.json").write_text(json.dumps(spec))
    return AutoTokenizer.from_pretrained(into)


def convert(vendor: Path, folder: Path, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(vendor / "gguf-py"))  # its own gguf-py, not the installed one
    return subprocess.run([sys.executable, str(vendor / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(out),
                           "--outtype", "f32"], env=env, capture_output=True, text=True)


@pytest.mark.parametrize("hidden", [64, 576, 896, 2048, 4096])
def test_the_ffn_mult_written_gives_each_width_back_through_the_readers_formula(hidden):
    for width in range(FFN_TILE, 4 * hidden + 1, FFN_TILE):
        mult = ffn_mult(width, hidden)
        # the readers' formula, written out (llama.cpp's conversion/deci.py: int, then up to a multiple of 256)
        raw = int(2 * mult * hidden / 3)
        assert (raw + (-raw) % 256) == width == readers_width(mult, hidden)
    with pytest.raises(ExportError, match="no ffn_mult gives the width 300 back"):
        ffn_mult(300, hidden)


def servable(layers: int = 3):
    """A tiny Llama 3 (its vocabulary) with attention that matters, MLP 768 = 3 x 256 wide."""
    model = llama(vocab_size=LLAMA3_VOCAB, hidden_size=64, intermediate_size=768, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=128000,
                  eos_token_id=128001, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    with torch.no_grad():
        for layer in model.model.layers:
            for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                           layer.self_attn.o_proj):
                linear.weight.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("case, match", [
    ("width", "layer 0's MLP width 700 is not a multiple of 256"),
    ("heads", "layer 1 lost query heads"),
    ("bias", "layer 0 has biases"),
    ("family", "a qwen3 model"),
])
def test_what_decilm_cannot_hold_is_refused_in_one_line_naming_the_servable_settings(case, match, tmp_path):
    from taylor_tune.sources.models import load_model

    model = servable()
    if case == "width":
        model = apply_plan(model, PrunePlan("hand", ((),) * 3, (tuple(range(68)), (), ())))
    if case == "heads":
        model = apply_plan(model, PrunePlan("hand", ((), (1,), ()), ((),) * 3))
    if case == "bias":
        model = llama(attention_bias=True)
    if case == "family":
        model = load_model("tiny-qwen3-random")
    with pytest.raises(ExportError, match=match) as raised:
        write_decilm(model, None, tmp_path / "out")
    assert "\n" not in str(raised.value) and "servable: true" in str(raised.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("plan", [
    PrunePlan("hand", ((),) * 3, (tuple(range(256)), (), tuple(range(512)))),  # widths 512, 768, 256: held
    PrunePlan("hand", ((),) * 3, ((), tuple(range(100)), ())),  # 668 wide
    PrunePlan("hand", ((), (0,), ()), ((),) * 3),  # a KV group (and its query heads) gone
    PrunePlan("hand", ((),) * 3, ((),) * 3, layers_removed=(1,)),  # depth: held
    PrunePlan("hand", ((), (), (1,)), ((),) * 3, layers_removed=(0,)),  # the third layer's heads, as the second
])
def test_the_recorded_plan_decides_what_the_rebuilt_model_would(plan):
    """`planned_problem` (before a rebuild, from pruning_summary.json's removed groups) against `servable_problem` of
    the model the plan prunes: both hold it, or both refuse it for the same reason (layer indices: the unpruned
    model's and the pruned model's)."""
    from taylor_tune.export.to_decilm import planned_problem, servable_problem

    summary = {"layers_removed": list(plan.layers_removed),
               "removed_groups": [{"layer": i, "attention_groups": list(a), "mlp_channels": list(m)}
                                  for i, (a, m) in enumerate(zip(plan.attn_removed, plan.mlp_removed))]}
    before, after = planned_problem(summary, 768), servable_problem(apply_plan(servable(), plan))
    assert (before is None) == (after is None)
    if before is not None:
        strip = lambda said: said.split(" ", 2)[2]  # noqa: E731 ("layer N ...": the numbering differs by depth)
        assert strip(before) == strip(after)


def vllm_reads(config) -> list[tuple[int, int, str]]:
    """What vLLM's nemotron_nas (`DeciLMDecoderLayer.__init__`) reads of a DeciLM config to build each layer, written
    out: the entry as objects (`block.attention.no_op`, `.n_heads_in_group`, `block.ffn.no_op`, `.ffn_mult` or
    `.intermediate_size`, `.hidden_act` if it has one), the model's fields beside it. (kv heads, MLP width, act)."""
    layers = []
    for index in range(config.num_hidden_layers):
        block = config.block_configs[index]
        assert block.attention.no_op is False and block.ffn.no_op is False
        kv_heads = config.num_attention_heads // block.attention.n_heads_in_group
        width = (readers_width(block.ffn.ffn_mult, config.hidden_size) if hasattr(block.ffn, "ffn_mult")
                 else block.ffn.intermediate_size)
        act = block.ffn.hidden_act if hasattr(block.ffn, "hidden_act") else config.hidden_act
        layers.append((kv_heads, width, act))
    return layers


def test_the_decilm_folders_config_reads_as_vllm_reads_it(tmp_path):
    """Issue 91, case 8: vLLM reads `block_configs` entries as objects, built by the checkpoint's own configuration
    class through AutoConfig with remote code; the folder shipped none (transformers does not know nemotron-nas), so
    it would not load there. Now the folder's configuration_decilm.py is that class: read as vLLM reads it, every
    layer's KV heads and MLP width are the exported model's, and the model's fields are its config's."""
    from transformers import AutoConfig

    from taylor_tune.pruning.groups import head_dim

    model = apply_plan(servable(), PrunePlan("hand", ((),) * 3, (tuple(range(256)), (), tuple(range(512)))))
    folder = write_decilm(model, None, tmp_path / "decilm")
    with pytest.raises(ValueError):  # its class is the folder's own code: read only when the reader allows it
        AutoConfig.from_pretrained(folder)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    assert type(config).__name__ == "DeciLMConfig" and config.model_type == "nemotron-nas"
    built = [(layer.self_attn.k_proj.out_features // head_dim(layer.self_attn), layer.mlp.gate_proj.out_features,
              model.config.hidden_act) for layer in model.model.layers]
    assert vllm_reads(config) == built == [(2, 512, "silu"), (2, 768, "silu"), (2, 256, "silu")]
    for field in ("hidden_size", "num_attention_heads", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                  "tie_word_embeddings", "rope_parameters", "hidden_act"):
        assert getattr(config, field) == getattr(model.config, field), field
    assert not getattr(config, "attention_bias", False) and not getattr(config, "mlp_bias", False)
    config.save_pretrained(tmp_path / "again")  # and written back as the same entries
    assert json.loads((tmp_path / "again" / "config.json").read_text())["block_configs"] == \
        json.loads((folder / "config.json").read_text())["block_configs"]


def servable_of_vocab(vocab_size: int):
    """A Llama DeciLM holds (MLP 256 wide, heads x head_dim = hidden) whose vocabulary is not Llama 3's."""
    return llama(vocab_size=vocab_size, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def spm_style_tokenizer(into: Path):
    """A BPE with byte fallback, normalised and decoded as SentencePiece's (Llama 2's, Mistral's) converted."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for piece in ("\u2581", "a", "b", "\u2581a", "ab"):
        vocab.setdefault(piece, len(vocab))
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "a"), ("a", "b")], byte_fallback=True,
                               unk_token="<unk>", fuse_unk=True))
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    bpe.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(into)
    return tokenizer


def test_the_export_says_when_llama_cpps_converter_would_refuse_the_folders_vocabulary(tmp_path):
    """Issue 91, case 8: llama.cpp's converter stopped on SmolLM2's DeciLM folder ("Cannot find Llama BPE tokenizer"):
    its deci reader takes Llama 3's vocabulary (by its size) or a SentencePiece-style BPE only. The rule, on each
    kind: a byte-level BPE (the world's, SmolLM2's kind) is named, with what to do instead; the other two pass."""
    from taylor_tune.export.to_decilm import converter_problem
    from taylor_tune.sources.models import load_tokenizer

    small = servable_of_vocab(512)  # not Llama 3's size
    said = converter_problem(write_decilm(small, load_tokenizer("tiny-llama"), tmp_path / "byte-level"))
    assert said is not None and "Cannot find Llama BPE tokenizer" in said and "export --gguf" in said
    assert "a BPE vocabulary without byte fallback" in said
    assert converter_problem(write_decilm(small, spm_style_tokenizer(tmp_path / "spm"), tmp_path / "spm-folder")) \
        is None
    assert converter_problem(write_decilm(servable(), load_tokenizer("tiny-llama"), tmp_path / "llama3")) is None


@pytest.mark.real  # the converter out of llama-cpp-python's source distribution (cached by the test below)
@pytest.mark.slow
def test_llama_cpps_own_vocabulary_reader_agrees_with_the_exports_word(tmp_path):
    """The same three folders read by llama.cpp's own code (its gguf-py's LlamaHfVocab, which conversion/deci.py uses
    for a vocabulary not of Llama 3's size; Llama 3's goes its BPE way): it refuses exactly the folder the export
    names."""
    from taylor_tune.export.to_decilm import converter_problem
    from taylor_tune.sources.models import load_tokenizer

    vendor = converter()
    small = servable_of_vocab(512)
    folders = {"byte-level": write_decilm(small, load_tokenizer("tiny-llama"), tmp_path / "byte-level"),
               "spm": write_decilm(small, spm_style_tokenizer(tmp_path / "spm"), tmp_path / "spm-folder")}
    for name, folder in folders.items():
        read = subprocess.run([sys.executable, "-c", "import sys, pathlib, gguf; gguf.LlamaHfVocab(pathlib.Path("
                               "sys.argv[1]))", str(folder)], capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(vendor / "gguf-py")))
        refused = read.returncode != 0
        assert refused == (converter_problem(folder) is not None), (name, read.stderr[-500:])
        assert not refused or "Cannot find Llama BPE tokenizer" in read.stderr


@pytest.mark.real  # fetches llama-cpp-python's source distribution (76 MB) into the asset cache once
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["aligned", "depth"])
def test_llama_cpps_own_converter_reads_the_decilm_export_as_the_model_computes(layout, tmp_path, monkeypatch):
    """The per-layer widths (512, 256, 768: each a multiple of 256, chosen by hand) or a layer removed, exported as
    DeciLM, converted by llama.cpp's converter, read by llama.cpp: every next token's log-probability within the
    export's f32 bounds of the pruned model's. The planted slip, ffn_mult written as width / hidden (not through the
    readers' formula), makes widths llama.cpp's loader refuses."""
    from taylor_tune.export import to_decilm
    from taylor_tune.export.to_gguf import TOLERANCE

    vendor = converter()
    tokenizer = llama3_tokenizer(vendor, tmp_path / "tokenizer")
    plan = (PrunePlan("hand", ((),) * 3, (tuple(range(0, 512, 2)), tuple(range(512)), ()))
            if layout == "aligned" else PrunePlan("hand", ((),) * 3, ((),) * 3, layers_removed=(1,)))
    model = apply_plan(servable(), plan)
    folder = write_decilm(model, tokenizer, tmp_path / "decilm")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DeciLMForCausalLM"]
    widths = [512, 256, 768] if layout == "aligned" else [768, 768]
    assert [readers_width(b["ffn"]["ffn_mult"], 64) for b in config["block_configs"]] == widths
    run = convert(vendor, folder, tmp_path / "model.gguf")
    assert run.returncode == 0, run.stderr[-3000:]
    tokens = tokenizer.encode("The river rises in the hills north of the town and flows south through farmland "
                              "for about forty miles before it reaches the sea.")
    gap = np.abs(gguf_logprobs(tmp_path / "model.gguf", tokens) - torch_logprobs(model, tokens))
    assert gap.mean() < TOLERANCE["f32"]["mean"] and gap.max() < TOLERANCE["f32"]["max"], (gap.mean(), gap.max())

    if layout == "aligned":  # 768 read back as ceil256(int(2 * 768 / 3)) = 512: the tensors no longer fit
        monkeypatch.setattr(to_decilm, "ffn_mult", lambda width, hidden: width / hidden)
        write_decilm(model, tokenizer, tmp_path / "slipped")
        run = convert(vendor, tmp_path / "slipped", tmp_path / "slipped.gguf")
        if run.returncode == 0:
            with pytest.raises(GGUFError, match="cannot load"):
                gguf_logprobs(tmp_path / "slipped.gguf", tokens)
