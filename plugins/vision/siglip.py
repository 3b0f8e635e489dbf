"""SigLIP's vision transformer as llama.cpp's `clip` files store it: patch embedding (a convolution
with kernel and stride the patch size), learned absolute positions, pre-norm blocks (LayerNorm,
bidirectional attention with biases, GELU-tanh MLP), a final LayerNorm.

A projector (Gemma 3's, ...) subclasses `SiglipEncoder`, binds its own `mm.*` tensors and maps the
patch states to the text model's embeddings in `project`.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import attrs
import numpy as np

from corral.gguf import GGUFFile
from corral.images import ImageSpec
from corral.model import TensorBinder, config_from_gguf, gguf_key, module, tensor
from corral.nn import MLP, LayerNorm, Linear, Vector


def _floats(values: Any) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


@attrs.frozen(kw_only=True)
class SiglipConfig:
    """The `clip.vision.*` keys of a projector file."""

    image_size: int = gguf_key("vision.image_size")
    patch_size: int = gguf_key("vision.patch_size")
    embedding_length: int = gguf_key("vision.embedding_length")
    feed_forward_length: int = gguf_key("vision.feed_forward_length")
    block_count: int = gguf_key("vision.block_count")
    head_count: int = gguf_key("vision.attention.head_count")
    norm_eps: float = gguf_key("vision.attention.layer_norm_epsilon", default=1e-6)
    image_mean: tuple[float, ...] = gguf_key("vision.image_mean", converter=_floats)
    image_std: tuple[float, ...] = gguf_key("vision.image_std", converter=_floats)
    projection_dim: int = gguf_key("vision.projection_dim")  # the text model's embedding width

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@attrs.frozen
class SiglipAttention:
    """q, k, v and output projections with biases (`attn_out` in clip files)."""

    q: Linear = tensor("q", Linear)
    k: Linear = tensor("k", Linear)
    v: Linear = tensor("v", Linear)
    out: Linear = tensor("out", Linear)


@attrs.frozen
class SiglipBlock:
    """x + attn(ln1(x)), then + mlp(ln2(x))."""

    attn: SiglipAttention = module(SiglipAttention, "attn_{}")
    ln1: LayerNorm = tensor("ln1", LayerNorm)
    ln2: LayerNorm = tensor("ln2", LayerNorm)
    ffn: MLP = module(MLP, "ffn_{}")

    def __call__(self, ctx: Any, x: Any, encoder: SiglipEncoder) -> Any:
        cfg = encoder.config
        heads, dim = cfg.head_count, cfg.embedding_length // cfg.head_count
        h = self.ln1(ctx, x, cfg.norm_eps)
        q, k, v = (ctx.reshape(proj(ctx, h), (-1, heads, dim)) for proj in (self.attn.q, self.attn.k, self.attn.v))
        x = x + self.attn.out(ctx, ctx.bidirectional_attention(q, k, v, [encoder.tower_rows], 1.0 / math.sqrt(dim)))
        return x + self.ffn(ctx, self.ln2(ctx, x, cfg.norm_eps), encoder.activation)


@attrs.frozen
class SiglipEncoder:
    """The vision tower; `encode(ctx, pixels)` builds the graph from pixels to the text model's embeddings."""

    Config: ClassVar[type] = SiglipConfig
    Block: ClassVar[type] = SiglipBlock
    projector_type: ClassVar[str]
    activation: ClassVar[str] = "gelu"  # the blocks' MLP activation (nn.activate's name)

    config: Any
    blocks: tuple[Any, ...]
    patch_embd: Vector = tensor("v.patch_embd", Vector)  # [dim, 3, patch, patch] and its bias
    position_embd: Vector = tensor("v.position_embd", Vector)  # [patches, dim]
    post_ln: LayerNorm = tensor("v.post_ln", LayerNorm)

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, backend: Any) -> SiglipEncoder:
        """Read the config and bind the tensors through the backend."""
        binder = TensorBinder(gguf, backend)
        config = config_from_gguf(cls.Config, gguf, "clip")
        blocks = tuple(binder.bind(cls.Block, f"v.blk.{i}.") for i in range(config.block_count))
        return binder.bind(cls, config=config, blocks=blocks)

    @property
    def patch_count(self) -> int:
        return self.config.patches_per_side**2

    @property
    def tower_rows(self) -> int:
        """Rows the tower's blocks run over: one per patch (CLIP adds its class row)."""
        return self.patch_count

    @property
    def output_width(self) -> int:
        """The width of the embeddings it gives: the text model's."""
        return self.config.projection_dim

    def image_spec(self) -> ImageSpec:
        """How images are prepared for this encoder."""
        cfg = self.config
        return ImageSpec(cfg.image_size, cfg.image_mean, cfg.image_std, "bilinear")

    def tokens_per_image(self) -> int:
        """Embeddings one image becomes (each takes a cell of the context)."""
        raise NotImplementedError

    def patch_states(self, ctx: Any, pixels: np.ndarray) -> Any:
        """The vision tower's output [patches, dim] for pixels [3, size, size] (row-major patches)."""
        cfg = self.config
        x = ctx.conv2d(ctx.float_input(pixels), self.patch_embd.weight, self.patch_embd.bias, cfg.patch_size)  # [dim, side, side]
        x = ctx.permute(ctx.reshape(x, (cfg.embedding_length, self.patch_count)), (1, 0))
        x = self.embed_patches(ctx, x)
        for block in self.blocks:
            x = block(ctx, x, self)
        return self.finish(ctx, x)

    def embed_patches(self, ctx: Any, patches: Any) -> Any:
        """The blocks' input rows from the patch embeddings [patches, dim]: SigLIP adds the positions."""
        return patches + self.position_embd.weight

    def finish(self, ctx: Any, states: Any) -> Any:
        """The patch states [patches, dim] from the last block's rows: SigLIP's final LayerNorm."""
        return self.post_ln(ctx, states, self.config.norm_eps)

    def project(self, ctx: Any, states: Any) -> Any:
        """Patch states [patches, dim] -> the text model's embeddings [tokens, projection_dim]."""
        raise NotImplementedError

    def encode(self, ctx: Any, pixels: np.ndarray) -> Any:
        """One image's embeddings for the text model [tokens_per_image, projection_dim]."""
        return self.project(ctx, self.patch_states(ctx, pixels))

