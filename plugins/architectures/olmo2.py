"""OLMo 2 and OLMo 3: no norms before attention and MLP, RMS norms on their outputs before each
residual add instead, RMS norms of q and k over all heads' features at once (not per head), RoPE
over halves (NeoX).

OLMo 3 files (the same architecture name) add `attention.sliding_window` and a per-layer
`attention.sliding_window_pattern`; their sliding layers rotate with `rope.freq_base_swa` and without the file's RoPE scaling.
"""

from __future__ import annotations

from typing import Any

import attrs

from corral.decoder import DecoderConfig, DecoderModel
from corral.hookspecs import hookimpl
from corral.model import gguf_key, module, tensor
from corral.nn import Attention, GatedMLP, RMSNorm

# llama.cpp's pattern for files with a window but no pattern: three sliding layers, then a global one.
DEFAULT_SLIDING_PATTERN = 4


@hookimpl
def register_architectures(register):
    register("olmo2", Olmo2Model)


@attrs.frozen(kw_only=True)
class Olmo2Config(DecoderConfig):
    # A bool per layer (True: sliding), or n for n - 1 sliding layers then a global one.
    sliding_window_pattern: Any = gguf_key("attention.sliding_window_pattern", default=None)
    rope_base_swa: float | None = gguf_key("rope.freq_base_swa", default=None)


@attrs.frozen
class Olmo2Block:
    attn: Attention = module(Attention, "attn_{}")
    post_attention_norm: RMSNorm = tensor("post_attention_norm", RMSNorm)
    ffn: GatedMLP = module(GatedMLP, "ffn_{}")
    post_ffw_norm: RMSNorm = tensor("post_ffw_norm", RMSNorm)

    def __call__(self, ctx, x, positions, cache, layer: int, model: Olmo2Model):
        eps = model.config.rms_eps
        x = x + self.post_attention_norm(ctx, self.attn(ctx, x, positions, cache, layer, model.attention_options(layer)), eps)
        return x + self.post_ffw_norm(ctx, self.ffn(ctx, x), eps)


@attrs.frozen
class Olmo2Model(DecoderModel):
    architecture = "olmo2"
    Config = Olmo2Config
    Block = Olmo2Block

    @classmethod
    def is_sliding(cls, cfg, layer: int) -> bool:
        if not cfg.sliding_window:
            return False
        pattern = cfg.sliding_window_pattern
        if isinstance(pattern, (list, tuple)):
            return bool(pattern[layer])
        n = pattern or DEFAULT_SLIDING_PATTERN
        return layer % n < n - 1

    def rope(self, layer: int):
        cfg = self.config
        if self.is_sliding(cfg, layer):
            return attrs.evolve(cfg.rope(neox=True, base=cfg.rope_base_swa), scale=1.0, yarn=None)
        return cfg.rope(neox=True)

    def attention_options(self, layer: int):
        return attrs.evolve(super().attention_options(layer), qk_norm="full")
