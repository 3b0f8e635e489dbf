"""OLMoE (OLMoE-1B-7B): Qwen 3 MoE's block with OLMo 2's attention, whose q and k RMS norms run over
all heads' features at once (not per head), NeoX RoPE, and a softmax router over SwiGLU experts whose
top-k weights are not renormalised.

The converter always writes an RMS epsilon of 1e-5 (OLMoE's own). `clip_qkv`, which no released
OLMoE sets, has no GGUF key; like llama.cpp, q, k and v are not clipped.
"""

from __future__ import annotations

import attrs

from corral.decoder import DecoderConfig, DecoderModel
from corral.hookspecs import hookimpl
from corral.model import gguf_key
from corral.plugins.architectures.qwen3moe import Qwen3MoeBlock


@hookimpl
def register_architectures(register):
    register("olmoe", OlmoeModel)


@attrs.frozen(kw_only=True)
class OlmoeConfig(DecoderConfig):
    # norm_topk_prob is false in OLMoE's releases; the converter writes no key and llama.cpp never renormalises.
    expert_weights_norm: bool = gguf_key("expert_weights_norm", default=False)


@attrs.frozen
class OlmoeModel(DecoderModel):
    architecture = "olmoe"
    Config = OlmoeConfig
    Block = Qwen3MoeBlock

    def attention_options(self, layer: int):
        return attrs.evolve(super().attention_options(layer), qk_norm="full")
