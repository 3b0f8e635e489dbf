"""IBM Granite 3.x MoE (granite-3.1-1b-a400m, -3b-a800m) and Granite MoE Shared: Granite's four
multipliers (embeddings, residuals, attention scores, logits) around a softmax router over SwiGLU
experts whose top-k weights are renormalised, plus a shared SwiGLU expert where the file has one
(`ffn_*_shexp`).

As for dense Granite, the converter permutes q and k as for Llama: RoPE turns adjacent pairs.
"""

from __future__ import annotations

import attrs

from corral.hookspecs import hookimpl
from corral.model import module, tensor
from corral.nn import Attention, MoE, MoEOptions, RMSNorm
from corral.plugins.architectures.granite import GraniteModel


@hookimpl
def register_architectures(register):
    register("granitemoe", GraniteMoeModel)


@attrs.frozen
class GraniteMoeBlock:
    attn_norm: RMSNorm = tensor("attn_norm", RMSNorm)
    attn: Attention = module(Attention, "attn_{}")
    ffn_norm: RMSNorm = tensor("ffn_norm", RMSNorm)
    moe: MoE = module(MoE)

    def __call__(self, ctx, x, positions, cache, layer: int, model: GraniteMoeModel):
        cfg = model.config
        attn = self.attn(ctx, self.attn_norm(ctx, x, cfg.rms_eps), positions, cache, layer, model.attention_options(layer))
        x = x + ctx.scale(attn, cfg.residual_scale)
        moe = self.moe(ctx, self.ffn_norm(ctx, x, cfg.rms_eps), MoEOptions(cfg.expert_used_count, normalize=True))
        return x + ctx.scale(moe, cfg.residual_scale)


@attrs.frozen
class GraniteMoeModel(GraniteModel):
    """Granite's config, multipliers and RoPE; only the block differs."""

    architecture = "granitemoe"
    Block = GraniteMoeBlock
