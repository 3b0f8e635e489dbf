"""Llama and the families built on its layout: Mistral, Mixtral, SmolLM3, Granite (and Granite MoE)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import gguf
import torch

from corral.convert.family import ExpertStacking, TextFamily, block_of, first, gguf_tensor
from corral.convert.folder import ConvertError, HFFolder
from corral.convert.vocab import TOKENIZER_MODEL


class LlamaFamily(TextFamily):
    """Llama, Mistral: q and k rows permuted for ggml's RoPE on adjacent pairs; Llama 3's scaling as rope_freqs."""

    arch = gguf.MODEL_ARCH.LLAMA

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        writer.add_vocab_size(self.config["vocab_size"])
        writer.add_rope_dimension_count(self.head_dim())

    def add_vocab(self, writer: gguf.GGUFWriter) -> None:
        model = (self.folder.json("tokenizer.json") or {}).get("model") or {}
        if not self.folder.has(TOKENIZER_MODEL) and model.get("type") == "BPE" and model.get("byte_fallback"):
            raise ConvertError(
                f"{self.folder.path}: a sentencepiece-style tokenizer.json without its tokenizer.model does not convert yet"
            )
        if (prefix := (self.folder.json("tokenizer_config.json") or {}).get("add_prefix_space")) is not None:
            writer.add_add_space_prefix(prefix)
        self.add_vocab_preferring_spm(writer)
        if self.config.get("vocab_size") == 49152:  # llama.cpp's rule for Granite's small models (and SmolLM's vocabulary)
            writer.add_add_bos_token(False)

    def head_dim(self) -> int:
        return self.config.get("head_dim") or self.config["hidden_size"] // self.config["num_attention_heads"]

    def modify(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        heads = first(self.config, "n_heads", "num_attention_heads")
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return pair_rope_rows(tensor, heads)
        if name.endswith(("k_proj.weight", "k_proj.bias")):
            return pair_rope_rows(tensor, first(self.config, "n_kv_heads", "num_key_value_heads", default=heads))
        return tensor

    def extra_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        rope = self.rope.get("full_attention", self.rope)
        if str(rope.get("rope_type", "")).lower() == "llama3":
            yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", llama3_rope_factors(rope, self.head_dim())


def pair_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Each head's rows reordered from Hugging Face's rotate-halves layout to ggml's adjacent pairs:
    row i of the first half goes to 2i, row i of the second half to 2i + 1."""
    halves = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return halves.transpose(1, 2).reshape(weight.shape)


def llama3_rope_factors(rope: dict[str, Any], dim: int) -> torch.Tensor:
    """Llama 3.1's per-frequency divisors: high frequencies kept, low ones divided by `factor`, a smooth ramp between."""
    base = rope.get("rope_theta", 10000.0)
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    context = rope.get("original_max_position_embeddings", 8192)
    frequencies = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    wavelengths = 2 * math.pi / frequencies  # float32 throughout, as llama.cpp computes them
    smooth = (context / wavelengths - low) / (high - low)
    ramp = 1 / ((1 - smooth) / factor + smooth)
    factors = torch.where(wavelengths > context / low, torch.tensor(factor, dtype=torch.float32), ramp)
    return torch.where(wavelengths < context / high, torch.tensor(1.0, dtype=torch.float32), factors)


class MixtralFamily(ExpertStacking, LlamaFamily):
    """Mixtral: a llama file with experts (ffn_*_exps)."""

    expert_kinds = ("w1", "w2", "w3")


class SmolLM3Family(LlamaFamily):
    arch = gguf.MODEL_ARCH.SMOLLM3


class GraniteFamily(LlamaFamily):
    """Granite: llama with four multipliers; its head_dim is ignored, as llama.cpp does (heads are hidden / count)."""

    arch = gguf.MODEL_ARCH.GRANITE
    SCALES = (
        ("attention_multiplier", "add_attention_scale"),
        ("embedding_multiplier", "add_embedding_scale"),
        ("residual_multiplier", "add_residual_scale"),
        ("logits_scaling", "add_logit_scale"),
    )

    def __init__(self, folder: HFFolder):
        super().__init__(folder)
        self.config.pop("head_dim", None)

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        for key, add in self.SCALES:
            if value := self.config.get(key):
                getattr(writer, add)(value)


class GraniteMoeFamily(GraniteFamily):
    """Granite MoE (and MoE Shared): JetMoE's fused gate+up experts split in two, a shared MLP likewise."""

    arch = gguf.MODEL_ARCH.GRANITE_MOE

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        if size := self.config.get("shared_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(size)

    def tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        block = block_of(name)
        if name.endswith("block_sparse_moe.input_linear.weight"):
            gate, up = tensor.split(self.config["intermediate_size"], dim=-2)
            yield gguf_tensor(gguf.MODEL_TENSOR.FFN_GATE_EXP, block), gate
            yield gguf_tensor(gguf.MODEL_TENSOR.FFN_UP_EXP, block), up
        elif name.endswith("shared_mlp.input_linear.weight"):
            gate, up = tensor.split(self.config["shared_intermediate_size"], dim=-2)
            shared = bool(self.config.get("num_local_experts"))
            yield gguf_tensor(gguf.MODEL_TENSOR.FFN_GATE_SHEXP if shared else gguf.MODEL_TENSOR.FFN_GATE, block), gate
            yield gguf_tensor(gguf.MODEL_TENSOR.FFN_UP_SHEXP if shared else gguf.MODEL_TENSOR.FFN_UP, block), up
        elif name.endswith("shared_mlp.output_linear.weight") and not self.config.get("num_local_experts"):
            yield gguf_tensor(gguf.MODEL_TENSOR.FFN_DOWN, block), tensor
        else:
            yield from super().tensors(name, tensor)

    def regroups(self, name: str) -> bool:
        return name.endswith(("block_sparse_moe.input_linear.weight", "shared_mlp.input_linear.weight", "shared_mlp.output_linear.weight"))
