"""gpt-oss (OpenAI's open-weight MoE): GQA attention with q/k/v/output biases and a learned sink
logit per head, sliding-window attention on even layers, NeoX RoPE with YaRN, and a biased router
whose top-k logits are softmaxed among themselves over experts with biases and the clamped SwiGLU
("swiglu_oai"). The post-attention norm is the MoE's input norm.

YaRN's ramp is not rounded to whole pairs: gpt-oss was trained that way (its config's `truncate:
false`), which GGUF does not record; llama.cpp rounds, and is off by ~1e-3 of the logits for it.
"""

from __future__ import annotations

import attrs

from corral.decoder import DecoderConfig, DecoderModel
from corral.hookspecs import hookimpl
from corral.model import gguf_key, module, tensor
from corral.nn import Attention, MoE, MoEOptions, RMSNorm


@hookimpl
def register_architectures(register):
    register("gpt-oss", GptOssModel)


@attrs.frozen(kw_only=True)
class GptOssConfig(DecoderConfig):
    sliding_window: int = gguf_key("attention.sliding_window")
    rope_base_swa: float | None = gguf_key("rope.freq_base_swa", default=None)


@attrs.frozen
class GptOssBlock:
    attn_norm: RMSNorm = tensor("attn_norm", RMSNorm)
    attn: Attention = module(Attention, "attn_{}")
    post_attention_norm: RMSNorm = tensor("post_attention_norm", RMSNorm)
    moe: MoE = module(MoE)

    def __call__(self, ctx, x, positions, cache, layer: int, model: GptOssModel):
        cfg = model.config
        x = x + self.attn(ctx, self.attn_norm(ctx, x, cfg.rms_eps), positions, cache, layer, model.attention_options(layer))
        h = self.post_attention_norm(ctx, x, cfg.rms_eps)
        return x + self.moe(ctx, h, MoEOptions(cfg.expert_used_count, gating="softmax_chosen", activation="swiglu_oai"))


@attrs.frozen
class GptOssModel(DecoderModel):
    architecture = "gpt-oss"
    Config = GptOssConfig
    Block = GptOssBlock

    @classmethod
    def is_sliding(cls, cfg, layer: int) -> bool:
        return layer % 2 == 0

    def rope(self, layer: int):
        # Sliding layers may name their own base; both kinds scale as the file says.
        base = self.config.rope_base_swa if self.is_sliding(self.config, layer) else None
        rope = self.config.rope(neox=True, base=base)
        return rope if rope.yarn is None else attrs.evolve(rope, yarn=attrs.evolve(rope.yarn, truncate=False))
