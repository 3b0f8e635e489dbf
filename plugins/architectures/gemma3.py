"""Gemma 3 (text): sliding-window layers 5 of every 6, local/global RoPE bases, QK-norm,
pre- and post-norms around attention and MLP, embeddings scaled by sqrt(hidden), GELU-tanh MLP.

The file's norm weights already include Gemma's `1 +`, so they are used as stored.
"""

from __future__ import annotations

import math

import attrs

from corral.decoder import DecoderConfig, DecoderModel
from corral.hookspecs import hookimpl
from corral.model import gguf_key
from corral.plugins.architectures.gemma2 import Gemma2Block, Gemma2Model

SLIDING_PATTERN = 6  # layers i with i % 6 < 5 are sliding-window layers
LOCAL_ROPE_BASE = 10000.0


@hookimpl
def register_architectures(register):
    register("gemma3", Gemma3Model)


@attrs.frozen(kw_only=True)
class Gemma3Config(DecoderConfig):
    key_length: int = gguf_key("attention.key_length", default=256)
    value_length: int = gguf_key("attention.value_length", default=256)
    context_length: int = gguf_key("context_length", default=32768)
    rms_eps: float = gguf_key("attention.layer_norm_rms_epsilon", default=1e-6)
    rope_base: float = gguf_key("rope.freq_base", default=1000000.0)
    sliding_window: int = gguf_key("attention.sliding_window", default=512)


@attrs.frozen
class Gemma3Model(DecoderModel):
    architecture = "gemma3"
    Config = Gemma3Config
    Block = Gemma2Block  # the same pre- and post-normed block; its attention binds the q/k norms Gemma 3 adds
    bidirectional_images = True  # an image's tokens see each other (transformers' token_type_ids mask, llama.cpp's non-causal image batch)

    @classmethod
    def image_markers(cls) -> tuple[str, str]:
        return "\n\n<start_of_image>", "<end_of_image>\n\n"  # what Gemma 3's processor writes around an image

    @classmethod
    def default_chat_template(cls) -> str:
        return Gemma2Model.default_chat_template()

    @classmethod
    def is_sliding(cls, cfg, layer: int) -> bool:
        return layer % SLIDING_PATTERN < SLIDING_PATTERN - 1

    def rope(self, layer: int):
        # Sliding layers rotate with the local base and no scaling; global ones as the file says.
        if self.is_sliding(self.config, layer):
            return attrs.evolve(self.config.rope(neox=True, base=LOCAL_ROPE_BASE), scale=1.0, yarn=None)
        return self.config.rope(neox=True)

    def embed(self, ctx, ids):
        return ctx.scale(self.token_embd(ctx, ids), math.sqrt(self.config.embedding_length))
