"""StarCoder 2: LayerNorms with biases (before attention, before the MLP, at the output), biased
q, k, v and output projections, a plain MLP (up, GELU in its tanh form, down) with biases, and RoPE
over halves (NeoX).

The biases are the file's `.bias` tensors, bound where present. Like llama.cpp, the model's
sliding window (4096 or more, in its config) is not applied: GGUF files do not carry it.
"""

from __future__ import annotations

import attrs

from corral.decoder import DecoderModel
from corral.hookspecs import hookimpl
from corral.model import module, tensor
from corral.nn import MLP, Attention, LayerNorm


@hookimpl
def register_architectures(register):
    register("starcoder2", Starcoder2Model)


@attrs.frozen
class Starcoder2Block:
    attn_norm: LayerNorm = tensor("attn_norm", LayerNorm)
    attn: Attention = module(Attention, "attn_{}")
    ffn_norm: LayerNorm = tensor("ffn_norm", LayerNorm)
    ffn: MLP = module(MLP, "ffn_{}")

    def __call__(self, ctx, x, positions, cache, layer: int, model: Starcoder2Model):
        eps = model.config.norm_eps
        x = x + self.attn(ctx, self.attn_norm(ctx, x, eps), positions, cache, layer, model.attention_options(layer))
        return x + self.ffn(ctx, self.ffn_norm(ctx, x, eps), activation="gelu")


@attrs.frozen
class Starcoder2Model(DecoderModel):
    architecture = "starcoder2"
    Block = Starcoder2Block

    output_norm: LayerNorm = tensor("output_norm", LayerNorm)

    def logits(self, ctx, x):
        return self.output(ctx, self.output_norm(ctx, x, self.config.norm_eps))
