"""Llama (SmolLM2, Llama 2/3.x, Mistral, Mixtral): RMSNorm, GQA attention with RoPE, SwiGLU MLP or
SwiGLU experts (`ffn_*_exps`: Mixtral-style top-k routing with renormalised weights).

The GGUF converter stores attn_q/attn_k rows permuted for ggml's RoPE, which rotates adjacent
pairs; the weights are used as stored and rotated the same way (not NeoX). Llama 3.1+ files carry
`rope_freqs` (per-pair frequency divisors); `attention.key_length` may differ from hidden / heads.
"""

from __future__ import annotations

import attrs

from corral.decoder import DecoderModel
from corral.hookspecs import hookimpl
from corral.model import module, tensor
from corral.nn import Attention, GatedMLP, MoE, MoEOptions, RMSNorm


@hookimpl
def register_architectures(register):
    register("llama", LlamaModel)


@attrs.frozen
class LlamaBlock:
    attn_norm: RMSNorm = tensor("attn_norm", RMSNorm)
    attn: Attention = module(Attention, "attn_{}")
    ffn_norm: RMSNorm = tensor("ffn_norm", RMSNorm)
    ffn: GatedMLP | None = module(GatedMLP, "ffn_{}", optional=True)
    moe: MoE | None = module(MoE, optional=True)

    def __call__(self, ctx, x, positions, cache, layer: int, model: LlamaModel):
        cfg = model.config
        x = x + self.attn(ctx, self.attn_norm(ctx, x, cfg.rms_eps), positions, cache, layer, model.attention_options(layer))
        h = self.ffn_norm(ctx, x, cfg.rms_eps)
        if self.moe is not None:
            return x + self.moe(ctx, h, MoEOptions(cfg.expert_used_count, normalize=True))
        return x + self.ffn(ctx, h)


@attrs.frozen
class LlamaModel(DecoderModel):
    architecture = "llama"
    Block = LlamaBlock
    rope_neox = False

    @classmethod
    def image_markers(cls) -> tuple[str, str]:
        return "", ""  # LLaVA's text model: an image is its embedding rows alone, in place of `<image>` (causal, as the text)
