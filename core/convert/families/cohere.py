"""Command R and Command R7B."""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import torch

from corral.convert.family import TextFamily, first
from corral.convert.folder import ConvertError, HFFolder


class CommandRFamily(TextFamily):
    """Command R: the context of model_max_length where given (config.json's max_position_embeddings undersells it)."""

    arch = gguf.MODEL_ARCH.COMMAND_R

    def __init__(self, folder: HFFolder):
        super().__init__(folder)
        self.config["max_position_embeddings"] = first(self.config, "model_max_length", "max_position_embeddings")

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        writer.add_logit_scale(self.config["logit_scale"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)


class Cohere2Family(TextFamily):
    """Command R7B: sliding window, partial rotary, and no biases (its all-zero ones are dropped)."""

    arch = gguf.MODEL_ARCH.COHERE2

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        config = self.config
        writer.add_logit_scale(config["logit_scale"])
        writer.add_sliding_window(config["sliding_window"])
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(int(config["rotary_pct"] * (config["hidden_size"] // config["num_attention_heads"])))
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)

    def tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name.endswith(".bias"):
            if torch.any(tensor != 0):
                raise ConvertError(f"{self.folder.path}: {name} is not zero; llama.cpp's Command R7B has no biases")
            return
        yield from super().tensors(name, tensor)

    def regroups(self, name: str) -> bool:
        return name.endswith(".bias")
