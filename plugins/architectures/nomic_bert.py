"""Nomic BERT (nomic-embed-text): BERT's post-norm encoder with a fused QKV projection and no
biases, RoPE over halves (NeoX) instead of position embeddings, and a SwiGLU MLP.
"""

from __future__ import annotations

import attrs

from corral.encoder import EncoderModel, PostNormBlock
from corral.hookspecs import hookimpl
from corral.model import module
from corral.nn import GatedMLP


@hookimpl
def register_architectures(register):
    register("nomic-bert", NomicBertModel)


@attrs.frozen
class NomicBertBlock(PostNormBlock):
    activation = "silu"
    ffn: GatedMLP = module(GatedMLP, "ffn_{}")


@attrs.frozen
class NomicBertModel(EncoderModel):
    architecture = "nomic-bert"
    Block = NomicBertBlock

    def rope(self):
        return self.config.rope(neox=True)
