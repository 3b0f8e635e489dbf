"""Gemma 3's vision side: SigLIP, then the projector: patch states average-pooled in k x k squares
(k = patches per side / tokens per side: 4 in every released size, `clip.vision.projector.scale_factor`
in test models), RMS-normed (`mm.soft_emb_norm`, the file's weight already holding Gemma's `1 +`) and
multiplied by `mm.input_projection` [vision dim, text dim] into the text model's embedding space.
"""

from __future__ import annotations

from typing import Any

import attrs

from corral.hookspecs import hookimpl
from corral.model import gguf_key, tensor
from corral.nn import RMSNorm, Vector
from corral.plugins.vision.siglip import SiglipConfig, SiglipEncoder

DEFAULT_MERGE = 4  # llama.cpp's value for every Gemma 3 size when the file names none


@hookimpl
def register_vision_encoders(register):
    register("gemma3", Gemma3VisionEncoder)


@attrs.frozen(kw_only=True)
class Gemma3VisionConfig(SiglipConfig):
    merge: int = gguf_key("vision.projector.scale_factor", default=DEFAULT_MERGE)


@attrs.frozen
class Gemma3VisionEncoder(SiglipEncoder):
    Config = Gemma3VisionConfig
    projector_type = "gemma3"

    soft_emb_norm: RMSNorm = tensor("mm.soft_emb_norm", RMSNorm)
    input_projection: Vector = tensor("mm.input_projection", Vector)  # [vision dim, text dim], used as x @ W

    def tokens_per_image(self) -> int:
        return (self.config.patches_per_side // self.config.merge) ** 2

    def project(self, ctx: Any, states: Any) -> Any:
        cfg = self.config
        k, side, dim = cfg.merge, cfg.patches_per_side // cfg.merge, cfg.embedding_length
        # Patch (row, col) = (R k + a, C k + b): gather each k x k square's rows together, then average them.
        squares = ctx.permute(ctx.reshape(states, (side, k, side, k, dim)), (0, 2, 1, 3, 4))
        pooled = ctx.scale(ctx.sum(ctx.reshape(squares, (side * side, k * k, dim)), dim=1), 1.0 / (k * k))
        return ctx.matmul(self.soft_emb_norm(ctx, pooled, cfg.norm_eps), self.input_projection.weight)
