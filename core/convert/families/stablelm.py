"""StableLM 3B and StableLM 2."""

from __future__ import annotations

import gguf

from corral.convert.family import TextFamily, first
from corral.convert.folder import ConvertError


class StableLMFamily(TextFamily):
    """StableLM (3B, 2): LayerNorms, partial rotary, the parallel block unless the config says otherwise."""

    arch = gguf.MODEL_ARCH.STABLELM

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        config = self.config
        if config.get("qk_layernorm"):
            raise ConvertError(f"{self.folder.path}: StableLM's per-head q/k LayerNorms (qk_layernorm) do not convert yet")
        writer.add_context_length(config["max_position_embeddings"])
        writer.add_embedding_length(config["hidden_size"])
        writer.add_block_count(self.blocks)
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_rope_dimension_count(int(self.rope["partial_rotary_factor"] * (config["hidden_size"] // config["num_attention_heads"])))
        writer.add_head_count(config["num_attention_heads"])
        writer.add_head_count_kv(config["num_key_value_heads"])
        writer.add_parallel_residual(config.get("use_parallel_residual", True))
        writer.add_layer_norm_eps(first(config, "layer_norm_eps", "norm_eps"))
