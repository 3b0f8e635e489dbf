"""DeepSeek V2 and V3 (multi-head latent attention)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import gguf
import torch

from corral.convert.family import ExpertStacking, first
from corral.convert.folder import ConvertError


class DeepSeekFamily(ExpertStacking):
    """DeepSeek V2 and V3 (multi-head latent attention): kv_b split into per-head k_b (transposed) and v_b,
    experts stacked, a tied lm_head and the multi-token-prediction layers dropped; GGUF's single KV head."""

    arch = gguf.MODEL_ARCH.DEEPSEEK2
    expert_kinds = ("down_proj", "gate_proj", "up_proj")

    def skip(self, name: str) -> bool:
        if self.config.get("tie_word_embeddings") and name in ("lm_head.weight", "model.lm_head.weight"):
            return True
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        return super().skip(name) or (layer is not None and int(layer[1]) >= self.blocks)

    def regroups(self, name: str) -> bool:
        return super().regroups(name) or name.endswith("kv_b_proj.weight")

    def tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if not name.endswith("kv_b_proj.weight"):
            yield from super().tensors(name, tensor)
            return
        config = self.config
        heads, nope, value = config["num_key_value_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
        if tensor.shape[0] != heads * (nope + value):
            raise ConvertError(f"{self.folder.path}: {name} has {tensor.shape[0]} rows, not heads x (qk_nope + v)")
        k_b, v_b = tensor.view(heads, nope + value, tensor.shape[-1]).split([nope, value], dim=1)
        yield name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)
        yield name.replace("kv_b_proj", "v_b_proj"), v_b

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        config = self.config
        config["num_key_value_heads"] = 1  # MLA's latent cache is one KV head (after the tensors were split)
        config.setdefault("rms_norm_eps", 1e-6)
        super().add_parameters(writer)
        moe = config.get("n_routed_experts") is not None
        dense = config.get("first_k_dense_replace")
        writer.add_leading_dense_block_count(dense if dense is not None else (0 if moe else config["num_hidden_layers"]))
        latent = config.get("kv_lora_rank", 512)
        writer.add_vocab_size(config["vocab_size"])
        if config.get("q_lora_rank") is not None:
            writer.add_q_lora_rank(config["q_lora_rank"])
        writer.add_kv_lora_rank(latent)
        writer.add_key_length(latent + config["qk_rope_head_dim"])
        writer.add_value_length(latent)
        writer.add_key_length_mla(config["qk_nope_head_dim"] + config["qk_rope_head_dim"])
        writer.add_value_length_mla(config["v_head_dim"])
        writer.add_expert_feed_forward_length(first(config, "moe_intermediate_size", "intermediate_size"))
        if moe:
            writer.add_expert_count(config["n_routed_experts"])
        writer.add_expert_shared_count(config.get("n_shared_experts", 0))
        if (scale := config.get("routed_scaling_factor")) is not None:
            writer.add_expert_weights_scale(scale)
        if config.get("norm_topk_prob"):
            writer.add_expert_weights_norm(True)
        writer.add_rope_dimension_count(config["qk_rope_head_dim"])
        if (mscale := self.rope.get("mscale_all_dim")) is not None:
            writer.add_rope_scaling_yarn_log_mul(0.1 * mscale)
