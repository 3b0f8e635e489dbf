"""BERT (all-MiniLM, BGE, E5 and other sentence encoders): absolute position and token type
embeddings, bidirectional attention with biases, post-norm blocks (LayerNorm after each residual),
an exact-GELU MLP with biases. Pooling (mean, CLS) comes from the file's `bert.pooling_type`.

llama.cpp's graph uses ggml's tanh-approximate GELU here; the checkpoints were trained with the
exact erf form (Hugging Face's `hidden_act: gelu`), which is what sentence-transformers computes.
"""

from __future__ import annotations

import attrs

from corral.encoder import EncoderModel, PostNormBlock
from corral.hookspecs import hookimpl
from corral.model import module
from corral.nn import MLP


@hookimpl
def register_architectures(register):
    register("bert", BertModel)


@attrs.frozen
class BertBlock(PostNormBlock):
    activation = "gelu_erf"
    ffn: MLP = module(MLP, "ffn_{}")


@attrs.frozen
class BertModel(EncoderModel):
    architecture = "bert"
    Block = BertBlock
