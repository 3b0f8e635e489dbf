"""The skeleton encoder architectures share (BERT and its descendants): bidirectional attention over
each whole input, no KV cache, post-norm blocks, hidden states for pooling instead of logits.

`EncoderModel` embeds the tokens (plus the first token type's row, "sentence A", and absolute
positions where the file has them), layer-norms them, runs the blocks and returns the requested
rows' hidden states. A Block is called as `block(ctx, x, positions, lengths, model)`: `lengths` are
the batch's consecutive runs of rows, one per input, that attention stays within.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, ClassVar

import attrs
import numpy as np

from corral.decoder import DecoderConfig
from corral.model import Batch, CacheLayer, Model, module, tensor
from corral.nn import Attention, AttentionOptions, Embedding, LayerNorm


@attrs.frozen(kw_only=True)
class EncoderConfig(DecoderConfig):
    """The decoder keys (an encoder reads the same block_count, heads, rope, ...) and its pooling."""


@attrs.frozen
class PostNormBlock:
    """BERT's block: LayerNorm after each residual sum. A subclass adds its `ffn` (called with
    `activation`) and any tensors of its own."""

    activation: ClassVar[str]
    attn: Attention = module(Attention, "attn_{}")
    attn_output_norm: LayerNorm = tensor("attn_output_norm", LayerNorm)
    layer_output_norm: LayerNorm = tensor("layer_output_norm", LayerNorm)

    def __call__(self, ctx: Any, x: Any, positions: Any, lengths: list[int], model: EncoderModel) -> Any:
        eps = model.config.norm_eps
        x = self.attn_output_norm(ctx, x + model.attend(ctx, self.attn, x, positions, lengths), eps)
        return self.layer_output_norm(ctx, x + self.ffn(ctx, x, self.activation), eps)


def sequence_lengths(sequences: np.ndarray) -> list[int]:
    """The lengths of the runs of equal ids in `sequences` (the batch's inputs, one run each)."""
    return [len(list(run)) for _, run in itertools.groupby(sequences.tolist())]


@attrs.frozen
class EncoderModel(Model):
    """Token (+ type, + position) embeddings, their layer norm, blocks; no output projection."""

    Config = EncoderConfig

    config: Any
    blocks: tuple[Any, ...]
    token_embd: Embedding = tensor("token_embd", Embedding)
    token_types: Embedding = tensor("token_types", Embedding, optional=True)
    position_embd: Embedding = tensor("position_embd", Embedding, optional=True)  # absolute positions (BERT); rope models have none
    token_embd_norm: LayerNorm = tensor("token_embd_norm", LayerNorm)

    @classmethod
    def cache_layout(cls, cfg: Any) -> list[CacheLayer]:
        return []  # no KV cache: every input is encoded whole in one pass

    def attention_options(self) -> AttentionOptions:
        cfg = self.config
        return AttentionOptions(cfg.head_count, cfg.kv_heads, cfg.key_dim, cfg.value_dim, self.rope(), scale=1.0 / math.sqrt(cfg.key_dim))

    def rope(self) -> Any:
        """How q and k rotate; None for absolute position embeddings."""
        return None

    def attend(self, ctx: Any, attn: Attention, x: Any, positions: Any, lengths: list[int]) -> Any:
        """Self-attention of `x` within each input, through the output projection."""
        opt = self.attention_options()
        q, k, v = attn.project(ctx, x, positions, opt)
        return attn.output(ctx, ctx.bidirectional_attention(q, k, v, lengths, opt.scale))

    def embed_tokens(self, ctx: Any, batch: Batch, positions: Any) -> Any:
        x = self.token_embd(ctx, ctx.input(batch.inputs))
        if self.token_types is not None:
            # Every input is one segment: token type 0 ("sentence A") for all rows, as llama.cpp does.
            x = x + self.token_types(ctx, ctx.input(np.zeros(len(batch), dtype=np.int64)))
        if self.position_embd is not None:
            x = x + self.position_embd(ctx, positions)
        return self.token_embd_norm(ctx, x, self.config.norm_eps)

    def hidden_states(self, ctx: Any, batch: Batch, cache: Any = None) -> Any:
        positions = ctx.input(batch.positions)
        lengths = sequence_lengths(batch.sequences)
        x = self.embed_tokens(ctx, batch, positions)
        for block in self.blocks:
            x = block(ctx, x, positions, lengths, self)
        return ctx.rows(x, ctx.input(batch.outputs))

    def forward(self, ctx: Any, batch: Batch, cache: Any) -> Any:
        raise NotImplementedError(f"{self.architecture} is an encoder: it embeds, it does not predict tokens")
