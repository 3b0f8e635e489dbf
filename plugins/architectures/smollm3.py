"""SmolLM3: Llama's block, with no rotary embedding on every 4th layer (NoPE).

GGUF files carry no key for which layers skip RoPE: llama.cpp fixes the step at 4 (layers 3, 7,
11, ...), transformers' default (`no_rope_layer_interval`) and what the released model uses. The
converter permutes q and k as for Llama, so RoPE turns adjacent pairs (not NeoX).
"""

from __future__ import annotations

import attrs

from corral.decoder import DecoderModel
from corral.hookspecs import hookimpl
from corral.plugins.architectures.llama import LlamaBlock

NO_ROPE_LAYER_STEP = 4


@hookimpl
def register_architectures(register):
    register("smollm3", SmolLM3Model)


@attrs.frozen
class SmolLM3Model(DecoderModel):
    architecture = "smollm3"
    Block = LlamaBlock
    rope_neox = False

    def rope(self, layer: int):
        return None if (layer + 1) % NO_ROPE_LAYER_STEP == 0 else super().rope(layer)
