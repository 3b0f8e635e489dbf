"""LLaVA's vision side, as llama.cpp's LLaVA image-encoder converter stores it (`clip.projector_type`
"mlp"): a CLIP ViT (patch embedding without bias, a class row in front, learned positions, a
LayerNorm before the blocks, QuickGELU MLPs) run to its second-to-last block (the file holds only
those blocks: LLaVA's `vision_feature_layer` -2), the class row dropped, then a two-layer MLP
(`mm.0`, exact GELU, `mm.2`) into the text model's embedding space. One embedding per patch.

The file's MLP names are swapped (`ffn_down` holds CLIP's fc1, the one that widens), as that converter
writes them; `ClipMLP` reads them so. Its `clip.vision.projection_dim` is CLIP's own contrastive width,
not the text model's: `from_gguf` puts `mm.2`'s width there.
"""

from __future__ import annotations

from typing import Any

import attrs

from corral.gguf import GGUFFile
from corral.hookspecs import hookimpl
from corral.images import ImageSpec
from corral.model import gguf_key, module, tensor
from corral.nn import LayerNorm, Linear, Vector, activate
from corral.plugins.vision.siglip import SiglipBlock, SiglipConfig, SiglipEncoder


@hookimpl
def register_vision_encoders(register):
    register("mlp", LlavaVisionEncoder)


@attrs.frozen(kw_only=True)
class ClipConfig(SiglipConfig):
    norm_eps: float = gguf_key("vision.attention.layer_norm_epsilon", default=1e-5)
    use_gelu: bool = gguf_key("use_gelu", default=False)  # the blocks' MLP: GELU, else CLIP's QuickGELU


@attrs.frozen
class ClipMLP:
    """fc2(act(fc1(x))), bound under the converter's swapped names."""

    fc1: Linear = tensor("down", Linear)
    fc2: Linear = tensor("up", Linear)

    def __call__(self, ctx: Any, x: Any, activation: str) -> Any:
        return self.fc2(ctx, activate(ctx, activation, self.fc1(ctx, x)))


@attrs.frozen
class ClipBlock(SiglipBlock):
    """SigLIP's pre-norm block with CLIP's MLP."""

    ffn: ClipMLP = module(ClipMLP, "ffn_{}")


@attrs.frozen
class LlavaVisionEncoder(SiglipEncoder):
    Config = ClipConfig
    Block = ClipBlock
    projector_type = "mlp"

    post_ln: LayerNorm = None  # the converter leaves CLIP's final norm out: LLaVA reads the states before it
    class_embd: Vector = tensor("v", Vector, suffix="class_embd")  # a lone tensor, `v.class_embd` [dim]
    pre_ln: LayerNorm = tensor("v.pre_ln", LayerNorm)
    mm_in: Linear = tensor("mm.0", Linear)
    mm_out: Linear = tensor("mm.2", Linear)

    @property
    def activation(self) -> str:
        return "gelu_erf" if self.config.use_gelu else "gelu_quick"

    @property
    def tower_rows(self) -> int:
        return self.patch_count + 1

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, backend: Any) -> LlavaVisionEncoder:
        encoder = super().from_gguf(gguf, backend)
        width = int(gguf.tensors["mm.2.weight"].shape[0])  # [text width, hidden] in torch's order
        return attrs.evolve(encoder, config=attrs.evolve(encoder.config, projection_dim=width))

    def image_spec(self) -> ImageSpec:
        cfg = self.config
        return ImageSpec(cfg.image_size, cfg.image_mean, cfg.image_std, "bicubic", fit="crop")  # CLIPImageProcessor's

    def tokens_per_image(self) -> int:
        return self.patch_count

    def embed_patches(self, ctx: Any, patches: Any) -> Any:
        cfg = self.config
        x = ctx.concat([ctx.reshape(self.class_embd.weight, (1, cfg.embedding_length)), patches], dim=0)
        return self.pre_ln(ctx, x + self.position_embd.weight, cfg.norm_eps)

    def finish(self, ctx: Any, states: Any) -> Any:
        return ctx.split(states, [1, self.patch_count], dim=0)[1]  # the class row is not an image token

    def project(self, ctx: Any, states: Any) -> Any:
        return self.mm_out(ctx, activate(ctx, "gelu_erf", self.mm_in(ctx, states)))
