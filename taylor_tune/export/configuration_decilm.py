"""DeciLM's configuration (`model_type: nemotron-nas`) as its readers take it, shipped in every `export --format
decilm` folder: transformers does not know the type, and vLLM's `nemotron_nas` loads a folder's configuration
through `AutoConfig.from_pretrained(..., trust_remote_code=True)` (`auto_map`), then reads each `block_configs` entry
as an object (`block.attention.no_op`, `block.attention.n_heads_in_group`, `block.ffn.ffn_mult`). A Llama config
whose entries are made such objects, and written back as the same JSON. Imports transformers alone: it runs in the
reader's process, not taylor_tune's."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from transformers import LlamaConfig


@dataclass(frozen=True)
class AttentionConfig:
    no_op: bool = False
    replace_with_linear: bool = False
    n_heads_in_group: int | None = None  # query heads per key/value head


@dataclass(frozen=True)
class FFNConfig:
    no_op: bool = False
    replace_with_linear: bool = False
    ffn_mult: float | None = None  # the width, as ceil256(int(2 * ffn_mult * hidden / 3))


@dataclass(frozen=True)
class BlockConfig:
    attention: AttentionConfig
    ffn: FFNConfig

    @classmethod
    def of(cls, entry: dict | BlockConfig) -> BlockConfig:
        if isinstance(entry, BlockConfig):
            return entry
        return cls(AttentionConfig(**entry["attention"]), FFNConfig(**entry["ffn"]))


class DeciLMConfig(LlamaConfig):
    model_type = "nemotron-nas"

    def __init__(self, block_configs: list | None = None, **kwargs):
        self.block_configs = [BlockConfig.of(entry) for entry in block_configs or []]
        super().__init__(**kwargs)

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["block_configs"] = [asdict(block) for block in self.block_configs]
        return out
