"""Command R (Cohere; also Aya 23): attention and SwiGLU MLP in parallel, both from one LayerNorm
without bias, added to the residual together; logits multiplied by `logit_scale`.

RoPE turns adjacent feature pairs, as Cohere's weights expect (the converter leaves q and k as they
are). Command R+ has q and k LayerNorms with one weight row per head; they are used where the file
has them.
"""

from __future__ import annotations

import attrs

from corral.decoder import DecoderConfig, DecoderModel
from corral.hookspecs import hookimpl
from corral.model import gguf_key, module, tensor
from corral.nn import Attention, GatedMLP, LayerNorm


@hookimpl
def register_architectures(register):
    register("command-r", CommandRModel)


@attrs.frozen(kw_only=True)
class CommandRConfig(DecoderConfig):
    logit_scale: float | None = gguf_key("logit_scale", default=None)


@attrs.frozen
class CohereAttention(Attention):
    q_norm: LayerNorm = tensor("q_norm", LayerNorm, optional=True)
    k_norm: LayerNorm = tensor("k_norm", LayerNorm, optional=True)


@attrs.frozen
class CommandRBlock:
    attn_norm: LayerNorm = tensor("attn_norm", LayerNorm)
    attn: CohereAttention = module(CohereAttention, "attn_{}")
    ffn: GatedMLP = module(GatedMLP, "ffn_{}")

    def __call__(self, ctx, x, positions, cache, layer: int, model: CommandRModel):
        h = self.attn_norm(ctx, x, model.config.norm_eps)
        return x + self.attn(ctx, h, positions, cache, layer, model.attention_options(layer)) + self.ffn(ctx, h)


@attrs.frozen
class CommandRModel(DecoderModel):
    architecture = "command-r"
    Config = CommandRConfig
    Block = CommandRBlock
    rope_neox = False

    output_norm: LayerNorm = tensor("output_norm", LayerNorm)

    def attention_options(self, layer: int):
        return attrs.evolve(super().attention_options(layer), norm_eps=self.config.norm_eps)

    def logits(self, ctx, x):
        cfg = self.config
        logits = self.output(ctx, self.output_norm(ctx, x, cfg.norm_eps))
        return ctx.scale(logits, cfg.logit_scale) if cfg.logit_scale else logits
