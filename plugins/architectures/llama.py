"""Llama (SmolLM2, Llama 2/3, Mistral-style): RMSNorm, GQA attention with RoPE, SwiGLU MLP.

The GGUF converter stores attn_q/attn_k rows permuted for ggml's RoPE, which rotates adjacent
pairs; the weights are used as stored and rotated the same way (`neox=False`).
"""

from __future__ import annotations

import math

import attrs

from corral.hookspecs import hookimpl
from corral.model import Batch, CacheLayer, Model, gguf_key, tensor
from corral.nn import Embedding, Linear, Logits, RMSNorm


@hookimpl
def register_architectures(register):
    register("llama", LlamaModel)


@attrs.frozen
class LlamaConfig:
    block_count: int = gguf_key("block_count")
    embedding_length: int = gguf_key("embedding_length")
    feed_forward_length: int = gguf_key("feed_forward_length")
    head_count: int = gguf_key("attention.head_count")
    head_count_kv: int = gguf_key("attention.head_count_kv", default=None)
    context_length: int = gguf_key("context_length", default=4096)
    rms_eps: float = gguf_key("attention.layer_norm_rms_epsilon", default=1e-5)
    rope_base: float = gguf_key("rope.freq_base", default=10000.0)
    rope_dims: int = gguf_key("rope.dimension_count", default=None)
    rope_scaling_factor: float = gguf_key("rope.scaling.factor", default=1.0)

    @property
    def head_dim(self) -> int:
        return self.embedding_length // self.head_count

    @property
    def kv_heads(self) -> int:
        return self.head_count_kv or self.head_count

    def rope(self) -> dict:
        return dict(dims=self.rope_dims or self.head_dim, base=self.rope_base, scale=1.0 / self.rope_scaling_factor, neox=False)


@attrs.frozen
class LlamaBlock:
    attn_norm: RMSNorm = tensor("attn_norm", RMSNorm)
    attn_q: Linear = tensor("attn_q", Linear)
    attn_k: Linear = tensor("attn_k", Linear)
    attn_v: Linear = tensor("attn_v", Linear)
    attn_output: Linear = tensor("attn_output", Linear)
    ffn_norm: RMSNorm = tensor("ffn_norm", RMSNorm)
    ffn_gate: Linear = tensor("ffn_gate", Linear)
    ffn_up: Linear = tensor("ffn_up", Linear)
    ffn_down: Linear = tensor("ffn_down", Linear)

    def __call__(self, ctx, x, positions, cache, layer: int, cfg: LlamaConfig):
        h = self.attn_norm(ctx, x, cfg.rms_eps)
        q = ctx.reshape(self.attn_q(ctx, h), (-1, cfg.head_count, cfg.head_dim))
        k = ctx.reshape(self.attn_k(ctx, h), (-1, cfg.kv_heads, cfg.head_dim))
        v = ctx.reshape(self.attn_v(ctx, h), (-1, cfg.kv_heads, cfg.head_dim))
        q, k = ctx.rope(q, positions, **cfg.rope()), ctx.rope(k, positions, **cfg.rope())
        attn = ctx.attention(q, k, v, cache, layer, 1.0 / math.sqrt(cfg.head_dim))
        x = x + self.attn_output(ctx, attn)
        h = self.ffn_norm(ctx, x, cfg.rms_eps)
        return x + self.ffn_down(ctx, ctx.silu(self.ffn_gate(ctx, h)) * self.ffn_up(ctx, h))


@attrs.frozen
class LlamaModel(Model):
    architecture = "llama"
    Config = LlamaConfig
    Block = LlamaBlock

    config: LlamaConfig
    blocks: tuple[LlamaBlock, ...]
    token_embd: Embedding = tensor("token_embd", Embedding)
    output_norm: RMSNorm = tensor("output_norm", RMSNorm)
    output: Logits = tensor("output", Logits, fallback="token_embd")

    @classmethod
    def cache_layout(cls, cfg: LlamaConfig) -> list[CacheLayer]:
        return [CacheLayer(cfg.kv_heads, cfg.head_dim, cfg.head_dim) for _ in range(cfg.block_count)]

    def shift_keys(self, ctx, layer, keys, delta):
        return ctx.rope(keys, delta, **self.config.rope())

    def forward(self, ctx, batch: Batch, cache):
        positions = ctx.input(batch.positions)
        x = self.token_embd(ctx, ctx.input(batch.inputs))
        for i, block in enumerate(self.blocks):
            x = block(ctx, x, positions, cache, i, self.config)
        x = ctx.rows(x, ctx.input(batch.outputs))
        return self.output(ctx, self.output_norm(ctx, x, self.config.rms_eps))
