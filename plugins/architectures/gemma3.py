"""Gemma 3 (text): sliding-window layers 5 of every 6, local/global RoPE bases, QK-norm,
pre- and post-norms around attention and MLP, embeddings scaled by sqrt(hidden), GELU-tanh MLP.

The file's norm weights already include Gemma's `1 +`, so they are used as stored.
"""

from __future__ import annotations

import importlib.resources
import math

import attrs

from corral.hookspecs import hookimpl
from corral.model import Batch, CacheLayer, Model, gguf_key, tensor
from corral.nn import Embedding, Linear, Logits, RMSNorm

SLIDING_PATTERN = 6  # layers i with i % 6 < 5 are sliding-window layers
LOCAL_ROPE_BASE = 10000.0


@hookimpl
def register_architectures(register):
    register("gemma3", Gemma3Model)


@attrs.frozen
class Gemma3Config:
    block_count: int = gguf_key("block_count")
    embedding_length: int = gguf_key("embedding_length")
    feed_forward_length: int = gguf_key("feed_forward_length")
    head_count: int = gguf_key("attention.head_count")
    head_count_kv: int = gguf_key("attention.head_count_kv")
    key_length: int = gguf_key("attention.key_length", default=256)
    value_length: int = gguf_key("attention.value_length", default=256)
    context_length: int = gguf_key("context_length", default=32768)
    rms_eps: float = gguf_key("attention.layer_norm_rms_epsilon", default=1e-6)
    rope_base: float = gguf_key("rope.freq_base", default=1000000.0)
    rope_scaling_factor: float = gguf_key("rope.scaling.factor", default=1.0)
    sliding_window: int = gguf_key("attention.sliding_window", default=512)

    def is_sliding(self, layer: int) -> bool:
        return layer % SLIDING_PATTERN < SLIDING_PATTERN - 1

    def rope(self, layer: int) -> dict:
        if self.is_sliding(layer):
            return dict(dims=self.key_length, base=LOCAL_ROPE_BASE, scale=1.0, neox=True)
        return dict(dims=self.key_length, base=self.rope_base, scale=1.0 / self.rope_scaling_factor, neox=True)


@attrs.frozen
class Gemma3Block:
    attn_norm: RMSNorm = tensor("attn_norm", RMSNorm)
    attn_q: Linear = tensor("attn_q", Linear)
    attn_k: Linear = tensor("attn_k", Linear)
    attn_v: Linear = tensor("attn_v", Linear)
    attn_q_norm: RMSNorm = tensor("attn_q_norm", RMSNorm)
    attn_k_norm: RMSNorm = tensor("attn_k_norm", RMSNorm)
    attn_output: Linear = tensor("attn_output", Linear)
    post_attention_norm: RMSNorm = tensor("post_attention_norm", RMSNorm)
    ffn_norm: RMSNorm = tensor("ffn_norm", RMSNorm)
    ffn_gate: Linear = tensor("ffn_gate", Linear)
    ffn_up: Linear = tensor("ffn_up", Linear)
    ffn_down: Linear = tensor("ffn_down", Linear)
    post_ffw_norm: RMSNorm = tensor("post_ffw_norm", RMSNorm)

    def __call__(self, ctx, x, positions, cache, layer: int, cfg: Gemma3Config):
        eps = cfg.rms_eps
        h = self.attn_norm(ctx, x, eps)
        q = ctx.reshape(self.attn_q(ctx, h), (-1, cfg.head_count, cfg.key_length))
        k = ctx.reshape(self.attn_k(ctx, h), (-1, cfg.head_count_kv, cfg.key_length))
        v = ctx.reshape(self.attn_v(ctx, h), (-1, cfg.head_count_kv, cfg.value_length))
        q, k = self.attn_q_norm(ctx, q, eps), self.attn_k_norm(ctx, k, eps)
        q, k = ctx.rope(q, positions, **cfg.rope(layer)), ctx.rope(k, positions, **cfg.rope(layer))
        attn = ctx.attention(q, k, v, cache, layer, 1.0 / math.sqrt(cfg.key_length))
        x = x + self.post_attention_norm(ctx, self.attn_output(ctx, attn), eps)
        h = self.ffn_norm(ctx, x, eps)
        ffn = self.ffn_down(ctx, ctx.gelu(self.ffn_gate(ctx, h)) * self.ffn_up(ctx, h))
        return x + self.post_ffw_norm(ctx, ffn, eps)


@attrs.frozen
class Gemma3Model(Model):
    architecture = "gemma3"
    Config = Gemma3Config
    Block = Gemma3Block

    config: Gemma3Config
    blocks: tuple[Gemma3Block, ...]
    token_embd: Embedding = tensor("token_embd", Embedding)
    output_norm: RMSNorm = tensor("output_norm", RMSNorm)
    output: Logits = tensor("output", Logits, fallback="token_embd")

    @classmethod
    def default_chat_template(cls) -> str:
        """Gemma's turns: the file carries no template."""
        return (importlib.resources.files(__package__) / "templates" / "gemma.jinja").read_text(encoding="utf-8")

    @classmethod
    def cache_layout(cls, cfg: Gemma3Config) -> list[CacheLayer]:
        return [
            CacheLayer(cfg.head_count_kv, cfg.key_length, cfg.value_length, cfg.sliding_window if cfg.is_sliding(i) else None)
            for i in range(cfg.block_count)
        ]

    def shift_keys(self, ctx, layer, keys, delta):
        return ctx.rope(keys, delta, **self.config.rope(layer))

    def forward(self, ctx, batch: Batch, cache):
        cfg = self.config
        positions = ctx.input(batch.positions)
        x = ctx.scale(self.token_embd(ctx, ctx.input(batch.inputs)), math.sqrt(cfg.embedding_length))
        for i, block in enumerate(self.blocks):
            x = block(ctx, x, positions, cache, i, cfg)
        x = ctx.rows(x, ctx.input(batch.outputs))
        return self.output(ctx, self.output_norm(ctx, x, cfg.rms_eps))
