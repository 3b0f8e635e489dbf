"""Qwen 3 (dense): Llama's block with RMS norms over each head of q and k before RoPE, RoPE over
halves (NeoX), no projection biases, and a head size of its own (`attention.key_length`, 128 in
every released size, which is not hidden / heads for most of them).
"""

from __future__ import annotations

import attrs

from corral.decoder import DecoderModel
from corral.hookspecs import hookimpl
from corral.plugins.architectures.llama import LlamaBlock


@hookimpl
def register_architectures(register):
    register("qwen3", Qwen3Model)


@attrs.frozen
class Qwen3Model(DecoderModel):
    architecture = "qwen3"
    Block = LlamaBlock
