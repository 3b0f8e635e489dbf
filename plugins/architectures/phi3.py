"""Phi-3 and Phi-4 (the converter writes both as phi3): RMSNorm, one fused qkv projection, SwiGLU
with gate and up fused in `ffn_up`, NeoX RoPE over `rope.dimension_count` features (a part of each
head in Phi-4-mini).

Long-context files (Phi-3-*-128k, Phi-3.5, Phi-4-mini) carry LongRoPE: `rope_factors_short` and
`rope_factors_long` divide the frequencies, the long ones when the context (num_ctx) exceeds the
original training context, as llama.cpp chooses (a context shift re-rotates with the short ones, see
ml.Context.rope); cos and sin are scaled by `rope.scaling.attn_factor` either way. The sliding window
some files name is ignored, as llama.cpp does.
"""

from __future__ import annotations

import attrs

from corral.decoder import DecoderConfig, DecoderModel
from corral.hookspecs import hookimpl
from corral.model import gguf_key, module, tensor
from corral.nn import Attention, GatedMLP, RMSNorm, Vector


@hookimpl
def register_architectures(register):
    register("phi3", Phi3Model)


@attrs.frozen(kw_only=True)
class Phi3Config(DecoderConfig):
    rope_attn_factor: float = gguf_key("rope.scaling.attn_factor", default=1.0)


@attrs.frozen
class Phi3Block:
    attn_norm: RMSNorm = tensor("attn_norm", RMSNorm)
    attn: Attention = module(Attention, "attn_{}")
    ffn_norm: RMSNorm = tensor("ffn_norm", RMSNorm)
    ffn: GatedMLP = module(GatedMLP, "ffn_{}")

    def __call__(self, ctx, x, positions, cache, layer: int, model: Phi3Model):
        cfg = model.config
        x = x + self.attn(ctx, self.attn_norm(ctx, x, cfg.rms_eps), positions, cache, layer, model.attention_options(layer))
        return x + self.ffn(ctx, self.ffn_norm(ctx, x, cfg.rms_eps), width=cfg.feed_forward_length)


@attrs.frozen
class Phi3Model(DecoderModel):
    architecture = "phi3"
    Config = Phi3Config
    Block = Phi3Block

    rope_factors_short: Vector = tensor("rope_factors_short", Vector, optional=True)
    rope_factors_long: Vector = tensor("rope_factors_long", Vector, optional=True)

    def rope(self, layer: int):
        cfg = self.config
        rope = cfg.rope(neox=True, freq_factors=self.rope_factors_short and self.rope_factors_short.weight)
        if self.rope_factors_long is None:
            return attrs.evolve(rope, attn_factor=cfg.rope_attn_factor)
        original = cfg.rope_original_context or cfg.context_length
        return attrs.evolve(rope, attn_factor=cfg.rope_attn_factor, long_factors=self.rope_factors_long.weight, original_context=original)
