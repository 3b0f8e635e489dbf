"""DeepSeek V2/V3/R1 and Kimi K2 (`deepseek2`): multi-head latent attention, then a dense SwiGLU MLP
in the first `leading_dense_block_count` blocks and routed plus shared SwiGLU experts in the rest.

Attention: q comes from one projection (`attn_q`, V2-Lite) or a low-rank pair around an RMSNorm
(`attn_q_a`, `attn_q_a_norm`, `attn_q_b`); k and v from a shared latent (`attn_kv_a_mqa`: the
latent and one rotary key for all heads; `attn_kv_a_norm`). Only each head's last `rope.dimension_count`
features rotate (adjacent pairs, YaRN with DeepSeek's mscale folded into the attention scale as
llama.cpp computes it). Files with the split `attn_k_b`/`attn_v_b` (what the converter writes,
`attention.key_length_mla` set) attend as llama.cpp's MLA does: q_nope is absorbed into the latent
through k_b, every head attends to one cached key [rope | latent] and value [latent], and v_b
expands each head's result; the cache holds kv_lora_rank * 2 + rope values a token, not the heads'
decompressed keys and values. Older files with one `attn_kv_b` decompress per head instead.

Routing: softmax (V2) or sigmoid (V3, `expert_gating_func`) scores, the `exp_probs_b` bias for
choosing only, the best `expert_group_used_count` of `expert_group_count` groups (V3 scores a
group by its best two experts, as llama.cpp does; V2 by its best one, as DeepSeek's V2 code does
where llama.cpp uses two), optionally renormalised and scaled weights.
"""

from __future__ import annotations

import math

import attrs

from corral.decoder import DecoderConfig, DecoderModel
from corral.errors import GGUFError, MissingTensorError
from corral.hookspecs import hookimpl
from corral.model import gguf_key, module, tensor
from corral.nn import Experts, GatedMLP, Linear, MoE, MoEOptions, RMSNorm

GATING = {0: "softmax", 1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func; absent (0) is softmax for deepseek2


@hookimpl
def register_architectures(register):
    register("deepseek2", Deepseek2Model)


@attrs.frozen(kw_only=True)
class Deepseek2Config(DecoderConfig):
    rms_eps: float = gguf_key("attention.layer_norm_rms_epsilon", default=1e-6)
    leading_dense_block_count: int = gguf_key("leading_dense_block_count", default=0)
    kv_lora_rank: int = gguf_key("attention.kv_lora_rank")
    # Set where k_b and v_b are split (MLA): the per-head sizes; key_length/value_length then describe the latent.
    key_length_mla: int | None = gguf_key("attention.key_length_mla", default=None)
    value_length_mla: int | None = gguf_key("attention.value_length_mla", default=None)
    expert_weights_scale: float = gguf_key("expert_weights_scale", default=0.0)
    expert_weights_norm: bool = gguf_key("expert_weights_norm", default=False)
    expert_gating_func: int = gguf_key("expert_gating_func", default=0)
    expert_group_count: int = gguf_key("expert_group_count", default=0)
    expert_group_used_count: int = gguf_key("expert_group_used_count", default=0)
    rope_attn_factor: float = gguf_key("rope.scaling.attn_factor", default=1.0)
    rope_yarn_log_mul: float = gguf_key("rope.scaling.yarn_log_multiplier", default=0.0)  # 0.1 * mscale_all_dim

    def __attrs_post_init__(self):
        if self.expert_gating_func not in GATING:
            raise GGUFError(f"deepseek2 expert_gating_func {self.expert_gating_func} is not supported (softmax 1 or sigmoid 2)")

    @property
    def latent(self) -> bool:
        """Whether the file's attention is MLA with split k_b/v_b (the cache then holds the latent)."""
        return self.key_length_mla is not None and self.value_length_mla is not None

    @property
    def head_key_dim(self) -> int:
        return self.key_length_mla if self.latent else self.key_dim

    @property
    def head_value_dim(self) -> int:
        return self.value_length_mla if self.latent else self.value_dim


@attrs.frozen
class LatentAttention:
    """Multi-head latent attention, bound at `attn_{}`."""

    q: Linear = tensor("q", Linear, optional=True)
    q_a: Linear = tensor("q_a", Linear, optional=True)
    q_a_norm: RMSNorm = tensor("q_a_norm", RMSNorm, optional=True)
    q_b: Linear = tensor("q_b", Linear, optional=True)
    kv_a_mqa: Linear = tensor("kv_a_mqa", Linear)
    kv_a_norm: RMSNorm = tensor("kv_a_norm", RMSNorm)
    k_b: Experts = tensor("k_b", Experts, optional=True)  # per head [kv_lora, nope]: absorbs q_nope into the latent
    v_b: Experts = tensor("v_b", Experts, optional=True)  # per head [v, kv_lora]: expands the attended latent
    kv_b: Linear = tensor("kv_b", Linear, optional=True)  # older files: every head's k_nope and v from the latent
    output: Linear = tensor("output", Linear)

    def __attrs_post_init__(self) -> None:
        if self.q is None and None in (self.q_a, self.q_a_norm, self.q_b):
            raise MissingTensorError("deepseek2 attention needs attn_q or attn_q_a, attn_q_a_norm and attn_q_b; the file has neither")
        if self.kv_b is None and None in (self.k_b, self.v_b):
            raise MissingTensorError("deepseek2 attention needs attn_k_b and attn_v_b or attn_kv_b; the file has neither")

    def __call__(self, ctx, x, positions, cache, layer: int, model: Deepseek2Model):
        cfg = model.config
        heads, rot, rank, dv = cfg.head_count, cfg.rope_dims, cfg.kv_lora_rank, cfg.head_value_dim
        nope = cfg.head_key_dim - rot
        rope = model.rope(layer)
        q = self.q(ctx, x) if self.q is not None else self.q_b(ctx, self.q_a_norm(ctx, self.q_a(ctx, x), cfg.rms_eps))
        q_nope, q_rot = ctx.split(ctx.reshape(q, (-1, heads, nope + rot)), (nope, rot))
        latent, k_rot = ctx.split(self.kv_a_mqa(ctx, x), (rank, rot))
        latent = self.kv_a_norm(ctx, latent, cfg.rms_eps)
        q_rot = ctx.rope(q_rot, positions, rope)
        k_rot = ctx.rope(ctx.reshape(k_rot, (-1, 1, rot)), positions, rope)
        # Rotated features first, so a context shift re-rotates the cached keys' leading features.
        if self.kv_b is None:
            latent = ctx.reshape(latent, (-1, 1, rank))
            q = ctx.concat((q_rot, ctx.stacked_linear(q_nope, self.k_b.weight)))  # [n, heads, rot + rank]
            out = ctx.attention(q, ctx.concat((k_rot, latent)), latent, cache, layer, model.attention_scale())
            out = ctx.stacked_linear(ctx.reshape(out, (-1, heads, rank)), self.v_b.weight)  # [n, heads, dv]
        else:
            k_nope, v = ctx.split(ctx.reshape(self.kv_b(ctx, latent), (-1, heads, nope + dv)), (nope, dv))
            k = ctx.concat((ctx.expand(k_rot, (-1, heads, -1)), k_nope))
            out = ctx.attention(ctx.concat((q_rot, q_nope)), k, v, cache, layer, model.attention_scale())
        return self.output(ctx, ctx.reshape(out, (-1, heads * dv)))


@attrs.frozen
class Deepseek2Block:
    attn_norm: RMSNorm = tensor("attn_norm", RMSNorm)
    attn: LatentAttention = module(LatentAttention, "attn_{}")
    ffn_norm: RMSNorm = tensor("ffn_norm", RMSNorm)
    ffn: GatedMLP | None = module(GatedMLP, "ffn_{}", optional=True)  # the leading dense blocks
    moe: MoE | None = module(MoE, optional=True)

    def __call__(self, ctx, x, positions, cache, layer: int, model: Deepseek2Model):
        eps = model.config.rms_eps
        x = x + self.attn(ctx, self.attn_norm(ctx, x, eps), positions, cache, layer, model)
        h = self.ffn_norm(ctx, x, eps)
        return x + (self.ffn(ctx, h) if self.moe is None else self.moe(ctx, h, model.moe_options()))


@attrs.frozen
class Deepseek2Model(DecoderModel):
    architecture = "deepseek2"
    Config = Deepseek2Config
    Block = Deepseek2Block
    rope_neox = False

    def rope(self, layer: int):
        cfg = self.config
        rope = cfg.rope(neox=False)
        if rope.yarn is None:
            return rope
        # With mscale_all_dim in the file the rotation keeps its length and the scale carries the correction.
        cancel = 1.0 / (1.0 + 0.1 * math.log(1.0 / rope.scale)) if cfg.rope_yarn_log_mul else 1.0
        return attrs.evolve(rope, attn_factor=cfg.rope_attn_factor * cancel)

    def attention_scale(self) -> float:
        """llama.cpp's kq_scale: 1/sqrt(head key dim), times YaRN's mscale squared."""
        cfg, rope = self.config, self.rope(0)
        if rope.yarn is None:
            return 1.0 / math.sqrt(cfg.head_key_dim)
        log_factor = math.log(1.0 / rope.scale)
        mscale = rope.attn_factor * (1.0 + 0.1 * log_factor) * (1.0 + cfg.rope_yarn_log_mul * log_factor)
        return mscale * mscale / math.sqrt(cfg.head_key_dim)

    def moe_options(self) -> MoEOptions:
        cfg = self.config
        gating = GATING[cfg.expert_gating_func]
        return MoEOptions(
            cfg.expert_used_count,
            gating=gating,
            normalize=cfg.expert_weights_norm,
            scale=cfg.expert_weights_scale or 1.0,
            experts=cfg.expert_count,
            groups=max(cfg.expert_group_count, 1),
            groups_used=cfg.expert_group_used_count,
            group_top=2 if gating == "sigmoid" else 1,
        )
