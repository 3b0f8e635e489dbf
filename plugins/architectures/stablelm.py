"""StableLM (StableLM 2 1.6B / 12B, StableLM 3B 4E1T, Zephyr): LayerNorms with biases, q, k and v
biased where the file says so (StableLM 2 1.6B), SwiGLU MLP, NeoX RoPE over the first
`rope.dimension_count` features of each head (a quarter in every release).

A file without `ffn_norm` runs attention and MLP in parallel from the one attention norm
(use_parallel_residual: StableLM 2 12B), and its q and k LayerNorms (one weight row per head, no
bias) are used where it has them, as Command R+'s.
"""

from __future__ import annotations

import attrs

from corral.decoder import DecoderModel
from corral.hookspecs import hookimpl
from corral.model import module, tensor
from corral.nn import GatedMLP, LayerNorm
from corral.plugins.architectures.command_r import CohereAttention


@hookimpl
def register_architectures(register):
    register("stablelm", StableLmModel)


@attrs.frozen
class StableLmBlock:
    attn_norm: LayerNorm = tensor("attn_norm", LayerNorm)
    attn: CohereAttention = module(CohereAttention, "attn_{}")
    ffn_norm: LayerNorm | None = tensor("ffn_norm", LayerNorm, optional=True)
    ffn: GatedMLP = module(GatedMLP, "ffn_{}")

    def __call__(self, ctx, x, positions, cache, layer: int, model: StableLmModel):
        eps = model.config.norm_eps
        h = self.attn_norm(ctx, x, eps)
        x = x + self.attn(ctx, h, positions, cache, layer, model.attention_options(layer))
        return x + self.ffn(ctx, h if self.ffn_norm is None else self.ffn_norm(ctx, x, eps))


@attrs.frozen
class StableLmModel(DecoderModel):
    architecture = "stablelm"
    Block = StableLmBlock

    output_norm: LayerNorm = tensor("output_norm", LayerNorm)

    def attention_options(self, layer: int):
        return attrs.evolve(super().attention_options(layer), norm_eps=self.config.norm_eps)

    def logits(self, ctx, x):
        return self.output(ctx, self.output_norm(ctx, x, self.config.norm_eps))
