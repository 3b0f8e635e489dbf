"""Gemma 2: sliding-window attention on every other layer, attention and final logits soft-capped
(cap * tanh(x / cap)), pre- and post-norms around attention and MLP, embeddings scaled by
sqrt(hidden), GELU-tanh MLP.

The file's norm weights already include Gemma's `1 +`, so they are used as stored. GGUF has no key
for query_pre_attn_scalar: like llama.cpp, queries scale by 1/sqrt(head_dim), except in the 27B
(46 layers), trained with 1/sqrt(hidden / heads).
"""

from __future__ import annotations

import importlib.resources
import math

import attrs

from corral.decoder import DecoderConfig, DecoderModel
from corral.hookspecs import hookimpl
from corral.model import gguf_key, module, tensor
from corral.nn import Attention, GatedMLP, RMSNorm

SLIDING_PATTERN = 2  # even layers attend within the window, odd ones globally
LAYERS_27B = 46


@hookimpl
def register_architectures(register):
    register("gemma2", Gemma2Model)


@attrs.frozen(kw_only=True)
class Gemma2Config(DecoderConfig):
    rms_eps: float = gguf_key("attention.layer_norm_rms_epsilon", default=1e-6)
    sliding_window: int = gguf_key("attention.sliding_window", default=4096)
    rope_base_swa: float | None = gguf_key("rope.freq_base_swa", default=None)
    attn_logit_softcapping: float = gguf_key("attn_logit_softcapping", default=50.0)
    final_logit_softcapping: float = gguf_key("final_logit_softcapping", default=30.0)

    @property
    def query_pre_attn_scalar(self) -> float:
        return self.embedding_length / self.head_count if self.block_count == LAYERS_27B else self.key_dim


@attrs.frozen
class Gemma2Block:
    attn_norm: RMSNorm = tensor("attn_norm", RMSNorm)
    attn: Attention = module(Attention, "attn_{}")
    post_attention_norm: RMSNorm = tensor("post_attention_norm", RMSNorm)
    ffn_norm: RMSNorm = tensor("ffn_norm", RMSNorm)
    ffn: GatedMLP = module(GatedMLP, "ffn_{}")
    post_ffw_norm: RMSNorm = tensor("post_ffw_norm", RMSNorm)

    def __call__(self, ctx, x, positions, cache, layer: int, model: Gemma2Model):
        eps = model.config.rms_eps
        attn = self.attn(ctx, self.attn_norm(ctx, x, eps), positions, cache, layer, model.attention_options(layer))
        x = x + self.post_attention_norm(ctx, attn, eps)
        ffn = self.ffn(ctx, self.ffn_norm(ctx, x, eps), activation="gelu")
        return x + self.post_ffw_norm(ctx, ffn, eps)


@attrs.frozen
class Gemma2Model(DecoderModel):
    architecture = "gemma2"
    Config = Gemma2Config
    Block = Gemma2Block

    @classmethod
    def default_chat_template(cls) -> str:
        """Gemma's turns, for a file that carries no template."""
        return (importlib.resources.files(__package__) / "templates" / "gemma.jinja").read_text(encoding="utf-8")

    @classmethod
    def is_sliding(cls, cfg, layer: int) -> bool:
        return layer % SLIDING_PATTERN < SLIDING_PATTERN - 1

    def rope(self, layer: int):
        cfg = self.config
        sliding_base = cfg.rope_base_swa if self.is_sliding(cfg, layer) else None
        return cfg.rope(neox=True, base=sliding_base)

    def attention_options(self, layer: int):
        cfg = self.config
        options = super().attention_options(layer)
        return attrs.evolve(options, scale=1.0 / math.sqrt(cfg.query_pre_attn_scalar), softcap=cfg.attn_logit_softcapping)

    def embed(self, ctx, ids):
        return ctx.scale(self.token_embd(ctx, ids), math.sqrt(self.config.embedding_length))

    def logits(self, ctx, x):
        return ctx.softcap(super().logits(ctx, x), self.config.final_logit_softcapping)
