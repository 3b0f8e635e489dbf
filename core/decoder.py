"""The skeleton most architectures share: a decoder-only transformer over the GGUF keys most files have.

`DecoderConfig` reads the common `<arch>.*` keys (an architecture subclasses it to add its own);
`DecoderModel` embeds the tokens, runs the blocks, norms and projects the output rows. A subclass
names its Config and Block, and overrides only what differs: `attention_options(layer)` (heads,
RoPE, window, softcap), `embed`, `logits`, `is_sliding`. A Block is called as
`block(ctx, x, positions, cache, layer, model)` and reads what it needs from the model.
"""

from __future__ import annotations

from typing import Any

import attrs

from corral.ml import Rope, Yarn
from corral.model import Batch, CacheLayer, Model, gguf_key, tensor
from corral.nn import AttentionOptions, Embedding, Logits, RMSNorm, Vector


@attrs.frozen(kw_only=True)
class DecoderConfig:
    """The keys most decoder files carry (llama.cpp's LLM_KV names), with llama.cpp's defaults."""

    block_count: int = gguf_key("block_count")
    embedding_length: int = gguf_key("embedding_length")
    feed_forward_length: int = gguf_key("feed_forward_length", default=0)
    head_count: int = gguf_key("attention.head_count")
    head_count_kv: int | None = gguf_key("attention.head_count_kv", default=None)
    key_length: int | None = gguf_key("attention.key_length", default=None)
    value_length: int | None = gguf_key("attention.value_length", default=None)
    context_length: int = gguf_key("context_length", default=4096)
    rms_eps: float = gguf_key("attention.layer_norm_rms_epsilon", default=1e-5)
    norm_eps: float = gguf_key("attention.layer_norm_epsilon", default=1e-5)
    rope_base: float = gguf_key("rope.freq_base", default=10000.0)
    rope_dims: int | None = gguf_key("rope.dimension_count", default=None)
    rope_scaling_type: str = gguf_key("rope.scaling.type", default="linear")  # llama.cpp's default when a file names none
    rope_scaling_factor: float = gguf_key("rope.scaling.factor", default=1.0)
    rope_original_context: int = gguf_key("rope.scaling.original_context_length", default=0)
    rope_yarn_ext_factor: float = gguf_key("rope.scaling.yarn_ext_factor", default=1.0)
    rope_yarn_beta_fast: float = gguf_key("rope.scaling.yarn_beta_fast", default=32.0)
    rope_yarn_beta_slow: float = gguf_key("rope.scaling.yarn_beta_slow", default=1.0)
    sliding_window: int | None = gguf_key("attention.sliding_window", default=None)
    expert_count: int = gguf_key("expert_count", default=0)
    expert_used_count: int = gguf_key("expert_used_count", default=0)
    expert_feed_forward_length: int = gguf_key("expert_feed_forward_length", default=0)
    pooling_type: int = gguf_key("pooling_type", default=0)  # an embedding model's pooling (Qwen3-Embedding: 3, last token)

    @property
    def kv_heads(self) -> int:
        return self.head_count_kv or self.head_count

    @property
    def key_dim(self) -> int:
        return self.key_length or self.embedding_length // self.head_count

    @property
    def value_dim(self) -> int:
        return self.value_length or self.key_dim

    @property
    def rope_scale(self) -> float:
        """The position multiplier: 1 / factor for linear and YaRN scaling, 1 otherwise."""
        scaled = self.rope_scaling_type in ("linear", "yarn") and self.rope_scaling_factor not in (0.0, 1.0)
        return 1.0 / self.rope_scaling_factor if scaled else 1.0

    def rope(self, *, neox: bool, base: float | None = None, freq_factors: Any = None) -> Rope:
        """The file's RoPE (with YaRN when the file says so); `base` for a layer's own base."""
        yarn = None
        if self.rope_scaling_type == "yarn" and self.rope_scale != 1.0:
            yarn = Yarn(self.rope_original_context or self.context_length, self.rope_yarn_ext_factor, self.rope_yarn_beta_fast, self.rope_yarn_beta_slow)
        return Rope(
            dims=self.rope_dims or self.key_dim,
            base=self.rope_base if base is None else base,
            scale=self.rope_scale,
            neox=neox,
            freq_factors=freq_factors,
            yarn=yarn,
        )


@attrs.frozen
class DecoderModel(Model):
    """Token embedding, blocks, final norm, output projection (tied to the embedding when the file has no `output`)."""

    Config = DecoderConfig
    # Rotates halves (NeoX, as the converter leaves most files) rather than adjacent pairs (llama's permuted q/k).
    rope_neox = True

    config: Any
    blocks: tuple[Any, ...]
    token_embd: Embedding = tensor("token_embd", Embedding)
    output_norm: RMSNorm = tensor("output_norm", RMSNorm)
    output: Logits = tensor("output", Logits, fallback="token_embd")
    rope_freqs: Vector = tensor("rope_freqs", Vector, optional=True)  # per-pair frequency divisors (Llama 3.1+)

    @classmethod
    def cache_layout(cls, cfg: Any) -> list[CacheLayer]:
        return [
            CacheLayer(cfg.kv_heads, cfg.key_dim, cfg.value_dim, cfg.sliding_window if cls.is_sliding(cfg, i) else None)
            for i in range(cfg.block_count)
        ]

    @classmethod
    def is_sliding(cls, cfg: Any, layer: int) -> bool:
        """Whether `layer` attends within the sliding window only."""
        return False

    def rope(self, layer: int) -> Rope | None:
        """How `layer` rotates q and k; None for a layer without RoPE."""
        return self.config.rope(neox=self.rope_neox, freq_factors=self.rope_freqs and self.rope_freqs.weight)

    def attention_options(self, layer: int) -> AttentionOptions:
        cfg = self.config
        return AttentionOptions(cfg.head_count, cfg.kv_heads, cfg.key_dim, cfg.value_dim, self.rope(layer), norm_eps=cfg.rms_eps)

    def embed(self, ctx: Any, ids: Any) -> Any:
        return self.token_embd(ctx, ids)

    def logits(self, ctx: Any, x: Any) -> Any:
        """The output rows' logits from the last block's output."""
        return self.output(ctx, self.output_norm(ctx, x, self.config.rms_eps))

    def shift_keys(self, ctx: Any, layer: int, keys: Any, delta: Any) -> Any:
        rope = self.rope(layer)
        return keys if rope is None else ctx.rope(keys, delta, attrs.evolve(rope, rotation_only=True))

    def hidden_states(self, ctx: Any, batch: Batch, cache: Any) -> Any:
        """The output rows after the final norm: what a decoder embedding model (Qwen3-Embedding) pools."""
        x = ctx.rows(self.blocks_output(ctx, batch, cache), ctx.input(batch.outputs))
        return self.output_norm(ctx, x, self.config.rms_eps)

    def blocks_output(self, ctx: Any, batch: Batch, cache: Any) -> Any:
        """Every row's hidden state after the last block."""
        positions = ctx.input(batch.positions)
        x = self.embed(ctx, ctx.input(batch.inputs))
        if batch.embeddings is not None:
            # Image embeddings go in after the token embedding (and its scaling): they are the text model's input as is.
            x = ctx.put_rows(x, ctx.input(batch.embedding_rows), ctx.float_input(batch.embeddings))
        for i, block in enumerate(self.blocks):
            x = block(ctx, x, positions, cache, i, self)
        return x

    def forward(self, ctx: Any, batch: Batch, cache: Any) -> Any:
        return self.logits(ctx, ctx.rows(self.blocks_output(ctx, batch, cache), ctx.input(batch.outputs)))
