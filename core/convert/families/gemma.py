"""Gemma 1, 2 and 3: norms stored with their +1, sentencepiece vocabularies."""

from __future__ import annotations

import gguf
import torch

from corral.convert.family import TextFamily
from corral.convert.folder import ConvertError
from corral.convert.vocab import TOKENIZER_MODEL, add_spm_vocab


class GemmaFamily(TextFamily):
    """Gemma (1): its own keys, sentencepiece only, norms +1, no output matrix; CodeGemma's fill-in-the-middle
    and end-of-turn ids as llama.cpp writes them for every Gemma (where gguf has keys for them)."""

    arch = gguf.MODEL_ARCH.GEMMA
    CODE_GEMMA_IDS = {"prefix": 67, "suffix": 69, "middle": 68, "fsep": 70, "eot": 107}

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        config = self.config
        writer.add_context_length(config["max_position_embeddings"])
        writer.add_embedding_length(config["hidden_size"])
        writer.add_block_count(self.blocks)
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_head_count(config["num_attention_heads"])
        writer.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])

    def add_vocab(self, writer: gguf.GGUFWriter) -> None:
        if not self.folder.has(TOKENIZER_MODEL):
            raise ConvertError(f"{self.folder.path} has no {TOKENIZER_MODEL}: a Gemma folder's tokenizer is read from it")
        add_spm_vocab(writer, self.folder)
        special = gguf.SpecialVocab(self.folder.path, load_merges=False, special_token_types=tuple(self.CODE_GEMMA_IDS))
        for kind, token in self.CODE_GEMMA_IDS.items():
            special.special_token_ids.setdefault(kind, token)  # the folder's own ids win
        special.chat_template = None  # written once, by add_spm_vocab
        special.add_to_gguf(writer, quiet=True)
        writer.add_add_space_prefix(False)

    def skip(self, name: str) -> bool:
        return super().skip(name) or name == "lm_head.weight"  # always tied; some exports carry a copy

    def modify(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + 1.0 if name.endswith("norm.weight") else tensor


class Gemma2Family(GemmaFamily):
    """Gemma 2: Gemma's keys and the soft caps and window; no CodeGemma ids."""

    arch = gguf.MODEL_ARCH.GEMMA2

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        writer.add_attn_logit_softcapping(self.config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(self.config["final_logit_softcapping"])
        writer.add_sliding_window(self.config["sliding_window"])

    def add_vocab(self, writer: gguf.GGUFWriter) -> None:
        if not self.folder.has(TOKENIZER_MODEL):
            raise ConvertError(f"{self.folder.path} has no {TOKENIZER_MODEL}: a Gemma 2 folder's tokenizer is read from it")
        add_spm_vocab(writer, self.folder)
        writer.add_add_space_prefix(False)


class Gemma3Family(TextFamily):
    """Gemma 3: the norms' +1 folded into their weights, embedding rows past the tokenizer's dropped, SWA. A
    Gemma3ForConditionalGeneration folder's vision tower and projector are left to corral.convert.projector."""

    arch = gguf.MODEL_ARCH.GEMMA3
    defaults = {
        "context_length": 131072,
        "head_count": 8,
        "rms_eps": 1e-6,
        "head_dim": 256,
        "head_count_kv": 4,
        "rope_theta": 1_000_000.0,
    }

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        if self.config.get("attn_logit_softcapping") is not None:
            raise ConvertError("a Gemma 3 config with attn_logit_softcapping: Gemma 3 has none")
        if cap := self.config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(cap)
        if self.config.get("sliding_window_pattern") != 1:
            writer.add_sliding_window(self.config["sliding_window"])

    def add_vocab(self, writer: gguf.GGUFWriter) -> None:
        if self.add_vocab_preferring_spm(writer):
            writer.add_add_space_prefix(False)

    def modify(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if "embed_tokens.weight" in name and (rows := self.tokenizer_rows()) is not None:
            tensor = tensor[:rows]
        if name.endswith("norm.weight"):
            tensor = tensor + 1.0  # Gemma3RMSNorm multiplies by (1 + weight)
        return tensor

    def tokenizer_rows(self) -> int | None:
        """How many embedding rows the tokenizer uses (the rest, padding, is dropped); None without a tokenizer."""
        if self.folder.has(TOKENIZER_MODEL):
            from corral.convert.vocab import spm_token_list

            return len(spm_token_list(self.folder)[0])
        if self.folder.has("tokenizer.json"):
            tokenizer = self.folder.json("tokenizer.json")
            return len(tokenizer["model"]["vocab"]) + len(tokenizer.get("added_tokens", []))
        return None
