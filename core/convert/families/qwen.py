"""Qwen 2 and 3, dense and mixture-of-experts."""

from __future__ import annotations

import gguf

from corral.convert.family import ExpertStacking, TextFamily, add_pooling


class Qwen2Family(TextFamily):
    arch = gguf.MODEL_ARCH.QWEN2

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        add_pooling(writer, self.folder)

    def add_vocab(self, writer: gguf.GGUFWriter) -> None:
        self.add_vocab_preferring_spm(writer)

    def rename(self, name: str) -> str:
        name = super().rename(name)
        return name if name.startswith(("model.", "lm_head")) else "model." + name  # a bare Qwen2Model's names


class Qwen3Family(Qwen2Family):
    arch = gguf.MODEL_ARCH.QWEN3


class Qwen2MoeFamily(ExpertStacking):
    arch = gguf.MODEL_ARCH.QWEN2MOE
    expert_kinds = ("down_proj", "gate_proj", "up_proj")


class Qwen3MoeFamily(Qwen2MoeFamily):
    arch = gguf.MODEL_ARCH.QWEN3MOE
