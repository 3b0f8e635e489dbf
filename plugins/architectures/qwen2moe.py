"""Qwen 1.5 MoE and Qwen 2 MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen 2's attention (GQA, biased q,
k and v, NeoX RoPE) over Qwen 3 MoE's block, with a softmax router whose top-k weights are not
renormalised, and a shared SwiGLU expert in every layer scaled by sigmoid(`ffn_gate_inp_shexp` x).

The MoE block binds the shared expert and its gate where the file has them; every qwen2moe file has both.
"""

from __future__ import annotations

import attrs

from corral.decoder import DecoderConfig, DecoderModel
from corral.hookspecs import hookimpl
from corral.model import gguf_key
from corral.plugins.architectures.qwen3moe import Qwen3MoeBlock


@hookimpl
def register_architectures(register):
    register("qwen2moe", Qwen2MoeModel)


@attrs.frozen(kw_only=True)
class Qwen2MoeConfig(DecoderConfig):
    rms_eps: float = gguf_key("attention.layer_norm_rms_epsilon", default=1e-6)
    # norm_topk_prob is false in every release; the converter writes no key and llama.cpp never renormalises.
    expert_weights_norm: bool = gguf_key("expert_weights_norm", default=False)


@attrs.frozen
class Qwen2MoeModel(DecoderModel):
    architecture = "qwen2moe"
    Config = Qwen2MoeConfig
    Block = Qwen3MoeBlock
