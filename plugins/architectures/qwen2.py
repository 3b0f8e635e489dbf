"""Qwen 2 and 2.5 (QwQ, Qwen2.5-Coder): Llama's block with biased q, k and v projections, and RoPE
over halves (NeoX): the converter leaves q and k unpermuted.

The biases are the file's `attn_{q,k,v}.bias`, which the attention block binds where present.
"""

from __future__ import annotations

import attrs

from corral.decoder import DecoderModel
from corral.hookspecs import hookimpl
from corral.plugins.architectures.llama import LlamaBlock


@hookimpl
def register_architectures(register):
    register("qwen2", Qwen2Model)


@attrs.frozen
class Qwen2Model(DecoderModel):
    architecture = "qwen2"
    Block = LlamaBlock
