"""Qwen 3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen 3's attention (GQA, per-head RMSNorm on q and k,
NeoX RoPE, head_dim from `attention.key_length`) with a softmax router over SwiGLU experts whose
top-k weights are renormalised, as llama.cpp runs every qwen3moe file.

Every layer routes: llama.cpp's converter refuses models with dense layers (`mlp_only_layers`,
`decoder_sparse_step` > 1), and llama.cpp would not load them.
"""

from __future__ import annotations

import attrs

from corral.decoder import DecoderConfig, DecoderModel
from corral.hookspecs import hookimpl
from corral.model import gguf_key, module, tensor
from corral.nn import Attention, MoE, MoEOptions, RMSNorm


@hookimpl
def register_architectures(register):
    register("qwen3moe", Qwen3MoeModel)


@attrs.frozen(kw_only=True)
class Qwen3MoeConfig(DecoderConfig):
    rms_eps: float = gguf_key("attention.layer_norm_rms_epsilon", default=1e-6)
    # llama.cpp always renormalises; the converter writes no key for it (norm_topk_prob).
    expert_weights_norm: bool = gguf_key("expert_weights_norm", default=True)


@attrs.frozen
class Qwen3MoeBlock:
    attn_norm: RMSNorm = tensor("attn_norm", RMSNorm)
    attn: Attention = module(Attention, "attn_{}")
    ffn_norm: RMSNorm = tensor("ffn_norm", RMSNorm)
    moe: MoE = module(MoE)

    def __call__(self, ctx, x, positions, cache, layer: int, model: Qwen3MoeModel):
        cfg = model.config
        x = x + self.attn(ctx, self.attn_norm(ctx, x, cfg.rms_eps), positions, cache, layer, model.attention_options(layer))
        h = self.ffn_norm(ctx, x, cfg.rms_eps)
        return x + self.moe(ctx, h, MoEOptions(cfg.expert_used_count, normalize=cfg.expert_weights_norm))


@attrs.frozen
class Qwen3MoeModel(DecoderModel):
    architecture = "qwen3moe"
    Config = Qwen3MoeConfig
    Block = Qwen3MoeBlock
