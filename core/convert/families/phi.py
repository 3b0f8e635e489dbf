"""Phi-2, Phi-3 and Phi-4."""

from __future__ import annotations

import math
from collections.abc import Iterator

import gguf
import torch

from corral.convert.family import TextFamily, first, gguf_tensor
from corral.convert.folder import ConvertError
from corral.convert.vocab import TOKENIZER_MODEL, add_json_vocab, spm_pieces, write_spm_tokens


class Phi2Family(TextFamily):
    """Phi-2: MHA, partial rotary, feed-forward 4 x hidden, no BOS."""

    arch = gguf.MODEL_ARCH.PHI2

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        hidden, heads = first(self.config, "hidden_size", "n_embd"), first(self.config, "num_attention_heads", "n_head")
        writer.add_context_length(first(self.config, "n_positions", "max_position_embeddings"))
        writer.add_embedding_length(hidden)
        writer.add_feed_forward_length(4 * hidden)
        writer.add_block_count(self.blocks)
        writer.add_head_count(heads)
        writer.add_head_count_kv(heads)
        writer.add_layer_norm_eps(first(self.config, "layer_norm_epsilon", "layer_norm_eps"))
        writer.add_rope_dimension_count(int(self.rope["partial_rotary_factor"] * hidden) // heads)

    def add_vocab(self, writer: gguf.GGUFWriter) -> None:
        super().add_vocab(writer)
        writer.add_add_bos_token(False)


class Phi3Family(TextFamily):
    """Phi-3 and Phi-4: LongRoPE's factors as tensors with their attention factor, the sliding window (0 for
    none), a sentencepiece vocabulary whose added tokens are all user-defined unless special (Phi-4's GPT-2
    tokenizer is a BPE tokenizer.json)."""

    arch = gguf.MODEL_ARCH.PHI3

    def rope_dims(self) -> int:
        hidden, heads = first(self.config, "hidden_size", "n_embd"), first(self.config, "num_attention_heads", "n_head")
        return int(self.rope.get("partial_rotary_factor", 1.0) * hidden) // heads

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        config = self.config
        writer.add_context_length(first(config, "n_positions", "max_position_embeddings"))
        writer.add_rope_scaling_orig_ctx_len(self.rope["original_max_position_embeddings"])
        writer.add_embedding_length(first(config, "hidden_size", "n_embd"))
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_block_count(self.blocks)
        writer.add_head_count(first(config, "num_attention_heads", "n_head"))
        writer.add_head_count_kv(first(config, "num_key_value_heads", "n_head_kv"))
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
        writer.add_rope_dimension_count(self.rope_dims())
        writer.add_rope_freq_base(self.rope.get("full_attention", self.rope)["rope_theta"])
        writer.add_sliding_window(config.get("sliding_window") or 0)
        if self.rope.get("long_factor"):
            writer.add_rope_scaling_attn_factors(self.long_rope_attention_factor())

    def long_rope_attention_factor(self) -> float:
        original = self.rope["original_max_position_embeddings"]
        scale = first(self.config, "n_positions", "max_position_embeddings") / original
        kind = str(self.rope.get("rope_type", "")).lower()
        if kind in ("su", "longrope"):
            return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        if kind == "yarn":
            return 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
        raise ConvertError(f"{self.folder.path}: Phi-3 rope scaling {kind or 'without a type'} does not convert")

    def extra_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        long, short = self.rope.get("long_factor"), self.rope.get("short_factor")
        if not long:
            return
        if short is None or len(long) != len(short) or len(long) != self.rope_dims() / 2:
            raise ConvertError(f"{self.folder.path}: LongRoPE needs long and short factors of {self.rope_dims() // 2} values each")
        yield gguf_tensor(gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, None), torch.tensor(long, dtype=torch.float32)
        yield gguf_tensor(gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT, None), torch.tensor(short, dtype=torch.float32)

    def add_vocab(self, writer: gguf.GGUFWriter) -> None:
        if (self.folder.json("tokenizer_config.json") or {}).get("tokenizer_class") == "GPT2Tokenizer":
            add_json_vocab(writer, self.folder)
            return
        if not self.folder.has(TOKENIZER_MODEL):
            raise ConvertError(f"{self.folder.path} has no {TOKENIZER_MODEL}: a Phi-3 folder's tokenizer is read from it")
        tokens, scores, types = spm_pieces(self.folder)
        added = list((self.folder.json("tokenizer_config.json") or {}).get("added_tokens_decoder", {}).items())
        added += [(token["id"], token) for token in (self.folder.json("tokenizer.json") or {}).get("added_tokens", [])]
        for key, token in added:
            i = int(key)
            tokens[i], scores[i] = token["content"].encode(), -1000.0
            types[i] = gguf.TokenType.CONTROL if token.get("special") else gguf.TokenType.USER_DEFINED
        write_spm_tokens(writer, self.folder, tokens, scores, types)
