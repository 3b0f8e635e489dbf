"""OLMo 2 and 3, OLMoE."""

from __future__ import annotations

import gguf

from corral.convert.families.qwen import Qwen2MoeFamily
from corral.convert.family import TextFamily, replace_key


class OlmoeFamily(Qwen2MoeFamily):
    """OLMoE: written with an RMS epsilon of 1e-5 whatever the config says, as llama.cpp does."""

    arch = gguf.MODEL_ARCH.OLMOE

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        replace_key(writer, gguf.Keys.Attention.LAYERNORM_RMS_EPS.format(arch=self.arch_name))
        writer.add_layer_norm_rms_eps(1e-5)


class Olmo2Family(TextFamily):
    """OLMo 2 and 3 (OLMo 3's sliding window and its per-layer pattern: every 4th layer global by default)."""

    arch = gguf.MODEL_ARCH.OLMO2

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        if "sliding_window" in self.config:
            writer.add_sliding_window(self.config["sliding_window"])
            kinds = self.config.get("layer_types")
            pattern = [kind == "sliding_attention" for kind in kinds] if kinds else [(i + 1) % 4 != 0 for i in range(self.blocks)]
            writer.add_sliding_window_pattern(pattern)
