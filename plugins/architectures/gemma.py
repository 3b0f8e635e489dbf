"""Gemma (1; also CodeGemma): Llama's block with a GELU-tanh gated MLP, RoPE over halves (NeoX),
embeddings scaled by sqrt(hidden), and the output always tied to the embedding.

The file's norm weights already include Gemma's `1 +` (the converter adds it), so they are used as
stored. Queries scale by 1/sqrt(head_dim), where head_dim (`attention.key_length`) need not be
hidden / heads (Gemma 7B: 16 heads of 256 over 3072).
"""

from __future__ import annotations

import math

import attrs

from corral.decoder import DecoderModel
from corral.hookspecs import hookimpl
from corral.model import module, tensor
from corral.nn import Attention, GatedMLP, Logits, RMSNorm
from corral.plugins.architectures.gemma2 import Gemma2Model


@hookimpl
def register_architectures(register):
    register("gemma", GemmaModel)


@attrs.frozen
class GemmaBlock:
    attn_norm: RMSNorm = tensor("attn_norm", RMSNorm)
    attn: Attention = module(Attention, "attn_{}")
    ffn_norm: RMSNorm = tensor("ffn_norm", RMSNorm)
    ffn: GatedMLP = module(GatedMLP, "ffn_{}")

    def __call__(self, ctx, x, positions, cache, layer: int, model: GemmaModel):
        eps = model.config.rms_eps
        x = x + self.attn(ctx, self.attn_norm(ctx, x, eps), positions, cache, layer, model.attention_options(layer))
        return x + self.ffn(ctx, self.ffn_norm(ctx, x, eps), activation="gelu")


@attrs.frozen
class GemmaModel(DecoderModel):
    architecture = "gemma"
    Block = GemmaBlock

    output: Logits = tensor("token_embd", Logits)  # as llama.cpp, even where a file has an `output`

    @classmethod
    def default_chat_template(cls) -> str:
        return Gemma2Model.default_chat_template()

    def embed(self, ctx, ids):
        return ctx.scale(self.token_embd(ctx, ids), math.sqrt(self.config.embedding_length))
