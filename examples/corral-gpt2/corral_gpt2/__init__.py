"""GPT-2 for corral: learned position embeddings, pre-LayerNorm blocks with biases, a fused QKV
projection, a GELU-tanh MLP, and the output tied to the token embedding unless the file has `output`.

Tensor and key names follow llama.cpp's GGUF conversion of GPT-2.
"""

from __future__ import annotations

import math

import attrs
from corral.hookspecs import hookimpl
from corral.model import Batch, CacheLayer, Model, gguf_key, tensor
from corral.nn import Embedding, LayerNorm, Linear, Logits

__version__ = "0.1.0"


@hookimpl
def register_architectures(register):
    register("gpt2", GPT2Model)


@attrs.frozen
class GPT2Config:
    block_count: int = gguf_key("block_count")
    embedding_length: int = gguf_key("embedding_length")
    feed_forward_length: int = gguf_key("feed_forward_length")
    head_count: int = gguf_key("attention.head_count")
    context_length: int = gguf_key("context_length", default=1024)
    norm_eps: float = gguf_key("attention.layer_norm_epsilon", default=1e-5)

    @property
    def head_dim(self) -> int:
        return self.embedding_length // self.head_count


@attrs.frozen
class GPT2Block:
    attn_norm: LayerNorm = tensor("attn_norm", LayerNorm)
    attn_qkv: Linear = tensor("attn_qkv", Linear)
    attn_output: Linear = tensor("attn_output", Linear)
    ffn_norm: LayerNorm = tensor("ffn_norm", LayerNorm)
    ffn_up: Linear = tensor("ffn_up", Linear)
    ffn_down: Linear = tensor("ffn_down", Linear)

    def __call__(self, ctx, x, cache, layer: int, cfg: GPT2Config):
        h = self.attn_norm(ctx, x, cfg.norm_eps)
        d = cfg.embedding_length
        q, k, v = ctx.split(self.attn_qkv(ctx, h), (d, d, d))
        q, k, v = (ctx.reshape(t, (-1, cfg.head_count, cfg.head_dim)) for t in (q, k, v))
        attn = ctx.attention(q, k, v, cache, layer, 1.0 / math.sqrt(cfg.head_dim))
        x = x + self.attn_output(ctx, attn)
        h = self.ffn_norm(ctx, x, cfg.norm_eps)
        return x + self.ffn_down(ctx, ctx.gelu(self.ffn_up(ctx, h)))


@attrs.frozen
class GPT2Model(Model):
    architecture = "gpt2"
    Config = GPT2Config
    Block = GPT2Block

    config: GPT2Config
    blocks: tuple[GPT2Block, ...]
    token_embd: Embedding = tensor("token_embd", Embedding)
    position_embd: Embedding = tensor("position_embd", Embedding)
    output_norm: LayerNorm = tensor("output_norm", LayerNorm)
    output: Logits = tensor("output", Logits, fallback="token_embd")

    @classmethod
    def cache_layout(cls, cfg):
        return [CacheLayer(cfg.head_count, cfg.head_dim, cfg.head_dim) for _ in range(cfg.block_count)]

    def forward(self, ctx, batch: Batch, cache):
        # Positions past context_length have no row in position_embd; the runtime caps num_ctx there.
        x = self.token_embd(ctx, ctx.input(batch.inputs)) + self.position_embd(ctx, ctx.input(batch.positions))
        for i, block in enumerate(self.blocks):
            x = block(ctx, x, cache, i, self.config)
        x = ctx.rows(x, ctx.input(batch.outputs))
        return self.output(ctx, self.output_norm(ctx, x, self.config.norm_eps))
