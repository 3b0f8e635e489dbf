"""Phi-2 (and Phi-1.5): attention and a GELU-tanh MLP in parallel, both from one LayerNorm with bias,
added to the residual together; biases on q, k, v, the output projections, the MLP and the logits;
NeoX RoPE over the first `rope.dimension_count` features of each head (Phi-2: 32 of 80).

The converter writes Phi-2 as multi-head attention (no GQA) and no rope base (always 10000).
"""

from __future__ import annotations

import attrs

from corral.decoder import DecoderModel
from corral.hookspecs import hookimpl
from corral.model import module, tensor
from corral.nn import MLP, Attention, LayerNorm


@hookimpl
def register_architectures(register):
    register("phi2", Phi2Model)


@attrs.frozen
class Phi2Block:
    attn_norm: LayerNorm = tensor("attn_norm", LayerNorm)
    attn: Attention = module(Attention, "attn_{}")
    ffn: MLP = module(MLP, "ffn_{}")

    def __call__(self, ctx, x, positions, cache, layer: int, model: Phi2Model):
        h = self.attn_norm(ctx, x, model.config.norm_eps)
        return x + self.attn(ctx, h, positions, cache, layer, model.attention_options(layer)) + self.ffn(ctx, h, activation="gelu")


@attrs.frozen
class Phi2Model(DecoderModel):
    architecture = "phi2"
    Block = Phi2Block

    output_norm: LayerNorm = tensor("output_norm", LayerNorm)

    def logits(self, ctx, x):
        return self.output(ctx, self.output_norm(ctx, x, self.config.norm_eps))
