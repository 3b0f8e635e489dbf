"""IBM Granite 3.x (dense): Llama with four multipliers from the file: embeddings times
`embedding_scale`, each block's attention and MLP output times `residual_scale` before its residual
add, attention scores times `attention.scale` (instead of 1/sqrt(head_dim)), and logits divided by
`logit_scale`.

The converter permutes q and k as for Llama, so RoPE turns adjacent pairs (not NeoX).
"""

from __future__ import annotations

import attrs

from corral.decoder import DecoderConfig, DecoderModel
from corral.hookspecs import hookimpl
from corral.model import gguf_key, module, tensor
from corral.nn import Attention, GatedMLP, RMSNorm


@hookimpl
def register_architectures(register):
    register("granite", GraniteModel)


@attrs.frozen(kw_only=True)
class GraniteConfig(DecoderConfig):
    # The converter writes a multiplier only when the model sets it; the defaults change nothing.
    embedding_scale: float = gguf_key("embedding_scale", default=1.0)
    residual_scale: float = gguf_key("residual_scale", default=1.0)
    attention_scale: float | None = gguf_key("attention.scale", default=None)
    logit_scale: float = gguf_key("logit_scale", default=1.0)


@attrs.frozen
class GraniteBlock:
    attn_norm: RMSNorm = tensor("attn_norm", RMSNorm)
    attn: Attention = module(Attention, "attn_{}")
    ffn_norm: RMSNorm = tensor("ffn_norm", RMSNorm)
    ffn: GatedMLP = module(GatedMLP, "ffn_{}")

    def __call__(self, ctx, x, positions, cache, layer: int, model: GraniteModel):
        cfg = model.config
        attn = self.attn(ctx, self.attn_norm(ctx, x, cfg.rms_eps), positions, cache, layer, model.attention_options(layer))
        x = x + ctx.scale(attn, cfg.residual_scale)
        return x + ctx.scale(self.ffn(ctx, self.ffn_norm(ctx, x, cfg.rms_eps)), cfg.residual_scale)


@attrs.frozen
class GraniteModel(DecoderModel):
    architecture = "granite"
    Config = GraniteConfig
    Block = GraniteBlock
    rope_neox = False

    def attention_options(self, layer: int):
        return attrs.evolve(super().attention_options(layer), scale=self.config.attention_scale)

    def embed(self, ctx, ids):
        return ctx.scale(self.token_embd(ctx, ids), self.config.embedding_scale)

    def logits(self, ctx, x):
        return ctx.scale(super().logits(ctx, x), 1.0 / self.config.logit_scale)
