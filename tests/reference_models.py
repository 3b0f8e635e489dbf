"""Tiny random models built with transformers' own classes: the numeric reference for each architecture.

Every entry of SPECS is one small model: a transformers config class with the settings that make it
tiny (and that vary what architectures vary: GQA ratio, head_dim, tied output, rope), the
`general.architecture` llama.cpp's converter must write for it, and the tokenizer it carries.
`convert_driver.py` builds each one (seeded, float32, eager attention), saves it with
`save_pretrained`, records transformers' logits on `reference_ids(spec)` and converts it with
`convert_hf_to_gguf.py --outtype f32`. Adding an architecture is one entry here; its tests are
test_reference_logits.py (logits against transformers) and test_conformance.py (cache, batching,
causality and context shift, as every plugin passes them).

A spec that corral cannot pass yet names the reason in `xfail` (strict: the tests fail once it passes,
so whoever fixes it removes the mark), and `xfail_checks` says which checks fail:

* "loads": the plugin binds the file through the registry;
* "runs": the conformance checks over corral alone (finite logits, cache, batching, causality, shift);
* "fp32_logits": precision "fp32" within 1e-4 of transformers' logits;
* "auto_argmax": precision "auto" keeps transformers' argmax where its margin is clear.

An architecture with no plugin yet is `xfail=NOT_IMPLEMENTED`: every check, and only with corral's
UnknownArchitectureError.

The driver imports this module next to llama.cpp's own gguf-py: only the functions the tests call
import corral or pytest.
"""

from __future__ import annotations

import os
import pathlib
import random
import subprocess
import sys
from typing import Any

import attrs
import numpy as np

NOT_IMPLEMENTED = "architecture not implemented yet"
CHECKS = frozenset({"loads", "runs", "fp32_logits", "auto_argmax"})

VOCAB_SIZE = 384
MIN_VOCAB_SIZE = 300
IDS_PER_MODEL = 20

# Shared by every spec unless it says otherwise. Weights are drawn with std 0.1 (about 1/sqrt(hidden),
# five times transformers' default) so every block moves the logits as much as the embedding does
# and a mistake in any block shows; the driver also moves norms and biases off their 1s and 0s
# (`convert_driver.perturb`).
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)


@attrs.frozen
class ReferenceSpec:
    """One tiny reference model: the config to build it from and what its GGUF must say."""

    name: str
    architecture: str  # the `general.architecture` the converter writes
    model_class: str  # a transformers class, built from `config_class(**TINY, **settings)`
    config_class: str
    settings: dict[str, Any] = attrs.field(factory=dict, hash=False)
    # "bpe": a byte-level BPE tokenizer.json; "gpt2": the same as a GPT2Tokenizer; "spm": a sentencepiece tokenizer.model
    tokenizer: str = "bpe"
    xfail: str | None = None
    xfail_checks: frozenset[str] = CHECKS

    def __attrs_post_init__(self):
        assert self.xfail_checks <= CHECKS, f"{self.name}: unknown checks {sorted(self.xfail_checks - CHECKS)}"
        # Byte-level tokenizers need 256 tokens and more; test_conformance's ids go up to tiny_gguf's 262.
        assert self.config_settings()["vocab_size"] >= MIN_VOCAB_SIZE, f"{self.name}: vocab_size under {MIN_VOCAB_SIZE}"

    def config_settings(self) -> dict[str, Any]:
        """The config's keyword arguments: TINY under this spec's settings."""
        return {**TINY, **self.settings}

    def fails(self, check: str | None) -> str | None:
        """Why `check` is expected to fail on this model today, or None (always None for no check)."""
        return self.xfail if check in self.xfail_checks else None


def reference_ids(spec: ReferenceSpec) -> list[int]:
    """The token ids a spec's logits are compared on: random, seeded by the spec's name."""
    rng = np.random.default_rng(list(spec.name.encode()))
    return [int(i) for i in rng.integers(0, spec.config_settings()["vocab_size"], IDS_PER_MODEL)]


def spec(
    name: str,
    architecture: str,
    family: str,
    *,
    config_class: str | None = None,
    tokenizer: str = "bpe",
    xfail: str | None = None,
    xfail_checks: frozenset[str] = CHECKS,
    **settings: Any,
) -> ReferenceSpec:
    """A spec of transformers' `<family>ForCausalLM` built from `<family>Config` (or `config_class`)."""
    return ReferenceSpec(
        name,
        architecture,
        f"{family}ForCausalLM",
        config_class or f"{family}Config",
        settings,
        tokenizer=tokenizer,
        xfail=xfail,
        xfail_checks=xfail_checks,
    )


# LongRoPE factors for a rope of 16 dims (8 frequencies); short ones apply to prompts within the
# original context, as these are.
SHORT_FACTORS = [1.0, 1.05, 1.1, 1.2, 1.4, 1.7, 2.0, 2.5]
LONG_FACTORS = [1.0, 1.2, 1.6, 2.4, 4.0, 6.0, 9.0, 12.0]
# YaRN over 4x an original context of 256 (transformers wants max_position_embeddings = 1024 with it).
YARN_4X = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 256}
SMALL_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

SPECS: list[ReferenceSpec] = [
    # --- llama ------------------------------------------------------------------------------------
    spec("llama-mha-tied", "llama", "Llama", num_key_value_heads=4, tie_word_embeddings=True),
    spec("llama-gqa-untied", "llama", "Llama", tie_word_embeddings=False, rope_theta=500000.0),
    spec("llama-mqa", "llama", "Llama", num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=1),
    # head_dim (attention.key_length) wider and narrower than hidden/heads, GQA 4:1.
    spec("llama-head-dim-wide", "llama", "Llama", head_dim=32, tie_word_embeddings=True),
    spec("llama-head-dim-narrow", "llama", "Llama", num_attention_heads=8, num_key_value_heads=2, head_dim=4),
    spec(
        "llama3-rope-scaling",
        "llama",
        "Llama",
        # The converter turns these into a rope_freqs.weight tensor.
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # Llama 2's sentencepiece vocabulary (the converter's other llama vocab path).
    spec("llama2-spm", "llama", "Llama", tokenizer="spm", num_key_value_heads=4, rms_norm_eps=1e-5),
    # A llama file with experts (ffn_*_exps), as the converter writes Mixtral.
    spec("mixtral", "llama", "Mixtral", num_local_experts=4, num_experts_per_tok=2),
    spec(
        "mixtral-mqa-tied",
        "llama",
        "Mixtral",
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
    # --- gemma ------------------------------------------------------------------------------------
    # Six layers: GGUF has no key for gemma3's sliding pattern; llama.cpp fixes it at 5 sliding
    # layers then 1 global, transformers' default. query_pre_attn_scalar = head_dim, as GGUF assumes.
    spec(
        "gemma3",
        "gemma3",
        "Gemma3",
        config_class="Gemma3TextConfig",
        num_hidden_layers=6,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=4,
    ),
    spec(
        "gemma3-rope-linear",
        "gemma3",
        "Gemma3",
        config_class="Gemma3TextConfig",
        num_hidden_layers=6,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=6,
        tie_word_embeddings=False,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    # Gemma 1's converter reads only a sentencepiece tokenizer.model, writes no rope_theta (every Gemma
    # uses 10000) and no output (llama.cpp always ties it). Heads wider than hidden / heads, as Gemma 7B's.
    spec("gemma", "gemma", "Gemma", tokenizer="spm", num_key_value_heads=4, head_dim=32),
    # MQA, as Gemma 2B; narrow heads, three layers.
    spec("gemma-mqa-narrow-head", "gemma", "Gemma", tokenizer="spm", num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=1, head_dim=8),
    spec("gemma-gqa", "gemma", "Gemma", tokenizer="spm", head_dim=16, rms_norm_eps=1e-5),
    # Gemma 2's converter reads only a sentencepiece tokenizer.model.
    spec(
        "gemma2",
        "gemma2",
        "Gemma2",
        tokenizer="spm",
        num_hidden_layers=4,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=4,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    # Caps small enough to bite, MQA, an odd layer count (the last one slides). The converter writes no
    # rope_theta for gemma2: every Gemma 2 uses 10000.
    spec(
        "gemma2-tight-caps-mqa",
        "gemma2",
        "Gemma2",
        tokenizer="spm",
        num_hidden_layers=3,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=6,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=2.0,
    ),
    # 46 layers is the 27B, which llama.cpp scales by 1/sqrt(hidden / heads), GGUF having no key for
    # query_pre_attn_scalar (here 16, where head_dim is 32).
    spec(
        "gemma2-27b-scale",
        "gemma2",
        "Gemma2",
        tokenizer="spm",
        num_hidden_layers=46,
        head_dim=32,
        query_pre_attn_scalar=16,
        sliding_window=5,
        initializer_range=0.05,
    ),
    # --- qwen -------------------------------------------------------------------------------------
    spec("qwen2", "qwen2", "Qwen2", tie_word_embeddings=True, rope_theta=1000000.0),
    spec("qwen2-untied", "qwen2", "Qwen2", num_attention_heads=8, num_key_value_heads=2),
    spec("qwen2-mha", "qwen2", "Qwen2", num_hidden_layers=3, num_key_value_heads=4, rope_theta=50000.0),
    # Qwen 2.5's long-context files: YaRN with llama.cpp's magnitude (transformers' default attention_factor).
    spec("qwen2-yarn", "qwen2", "Qwen2", max_position_embeddings=1024, rope_parameters=YARN_4X),
    spec("qwen3", "qwen3", "Qwen3", head_dim=32, tie_word_embeddings=True),
    spec("qwen3-mqa-narrow-head", "qwen3", "Qwen3", head_dim=8, num_attention_heads=8, num_key_value_heads=1, rope_theta=1000000.0),
    spec("qwen3-yarn", "qwen3", "Qwen3", head_dim=32, max_position_embeddings=1024, rope_parameters=YARN_4X),
    # norm_topk_prob: llama.cpp renormalises every qwen3moe file's weights (the converter writes no key for it).
    spec("qwen3moe", "qwen3moe", "Qwen3Moe", head_dim=32, num_experts=8, norm_topk_prob=True, **SMALL_MOE),
    spec(
        "qwen3moe-mqa-untied",
        "qwen3moe",
        "Qwen3Moe",
        num_attention_heads=8,
        num_key_value_heads=1,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    spec(
        "qwen3moe-tied",
        "qwen3moe",
        "Qwen3Moe",
        num_hidden_layers=3,
        head_dim=16,
        num_experts=4,
        norm_topk_prob=True,
        tie_word_embeddings=True,
        **SMALL_MOE,
    ),
    # Qwen 1.5 / 2 MoE: biased q, k, v; softmax routing without renormalisation (llama.cpp never
    # renormalises qwen2moe; norm_topk_prob is false in every release); a shared expert scaled by sigmoid(gate).
    spec("qwen2moe", "qwen2moe", "Qwen2Moe", num_experts=8, shared_expert_intermediate_size=48, **SMALL_MOE),
    spec(
        "qwen2moe-mqa-no-bias",
        "qwen2moe",
        "Qwen2Moe",
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=1,
        qkv_bias=False,
        num_experts=4,
        num_experts_per_tok=1,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=96,
        rope_theta=1000000.0,
    ),
    # OLMoE: q/k norms over all heads' features; softmax routing without renormalisation (norm_topk_prob
    # false, as released; the converter writes no key for it).
    spec("olmoe", "olmoe", "Olmoe", num_experts=8, num_experts_per_tok=2),
    # MHA as released, three layers, top-3 of 4 experts, another rope_theta.
    spec(
        "olmoe-mha",
        "olmoe",
        "Olmoe",
        num_hidden_layers=3,
        num_key_value_heads=4,
        num_experts=4,
        num_experts_per_tok=3,
        intermediate_size=48,
        rope_theta=500000.0,
    ),
    # --- phi3 -------------------------------------------------------------------------------------
    spec("phi3", "phi3", "Phi3", tokenizer="spm", num_key_value_heads=4, original_max_position_embeddings=256),
    spec(
        "phi3-longrope",
        "phi3",
        "Phi3",
        tokenizer="spm",
        original_max_position_embeddings=64,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": SHORT_FACTORS,
            "long_factor": LONG_FACTORS,
        },
    ),
    # 20 ids past an original context of 16: the long factors (transformers by sequence length, corral
    # by the cache's context, which logits() sizes to the ids).
    spec(
        "phi3-longrope-long",
        "phi3",
        "Phi3",
        tokenizer="spm",
        num_key_value_heads=1,
        original_max_position_embeddings=16,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT_FACTORS, "long_factor": LONG_FACTORS},
    ),
    # Phi-4: a GPT-2 style tokenizer, GQA, a larger rope_theta, no LongRoPE, untied output.
    spec(
        "phi4",
        "phi3",
        "Phi3",
        tokenizer="gpt2",
        num_attention_heads=8,
        num_key_value_heads=2,
        rope_theta=250000.0,
        original_max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
    # Phi-4-mini: LongRoPE over 3/4 of each head (12 of 16 features, 6 factors), tied output.
    spec(
        "phi4-mini-partial-rope",
        "phi3",
        "Phi3",
        tokenizer="gpt2",
        num_key_value_heads=1,
        tie_word_embeddings=True,
        original_max_position_embeddings=64,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": SHORT_FACTORS[:6],
            "long_factor": LONG_FACTORS[:6],
        },
    ),
    spec(
        "phi4-mini-partial-rope-long",
        "phi3",
        "Phi3",
        tokenizer="gpt2",
        tie_word_embeddings=True,
        original_max_position_embeddings=12,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": SHORT_FACTORS[:6],
            "long_factor": LONG_FACTORS[:6],
        },
    ),
    # --- deepseek2 (multi-head latent attention) --------------------------------------------------
    spec(
        "deepseek2-lite",
        "deepseek2",
        "DeepseekV2",
        num_key_value_heads=4,  # MLA's heads: transformers wants it equal to num_attention_heads
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        **SMALL_MOE,
    ),
    spec(
        "deepseek3-yarn",
        "deepseek2",
        "DeepseekV3",
        num_key_value_heads=4,
        max_position_embeddings=2560,  # factor x original, as transformers wants it
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        # What DeepSeek V3's config.json says (transformers' class hard-codes it; the converter reads it).
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        **SMALL_MOE,
    ),
    # V2's group-limited greedy routing (softmax, a group scored by its best expert) and V2's YaRN mscale.
    spec(
        "deepseek2-groups",
        "deepseek2",
        "DeepseekV2",
        num_key_value_heads=4,
        max_position_embeddings=2560,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        topk_method="group_limited_greedy",
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        **SMALL_MOE,
    ),
    # V3 without low-rank q, 8 heads, wider rope and nope than v, two dense blocks, tied output.
    spec(
        "deepseek3-mha-tied",
        "deepseek2",
        "DeepseekV3",
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        head_dim=16,
        v_head_dim=8,
        n_routed_experts=8,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=2,
        num_experts_per_tok=3,
        moe_intermediate_size=16,
        norm_topk_prob=False,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        tie_word_embeddings=True,
        rope_theta=50000.0,
    ),
    # --- the rest of issue 13's architectures -----------------------------------------------------
    spec("olmo2", "olmo2", "Olmo2"),
    spec("olmo2-gqa-tied", "olmo2", "Olmo2", num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500000.0),
    # OLMo 3 converts to olmo2 with a window and a per-layer pattern (here the default: every 4th global).
    spec("olmo3", "olmo2", "Olmo3", num_hidden_layers=4, sliding_window=4),
    spec(
        "olmo3-yarn-local-base",
        "olmo2",
        "Olmo3",
        num_hidden_layers=4,
        sliding_window=5,
        max_position_embeddings=1024,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        # Global layers scale by YaRN, sliding ones rotate unscaled at their own base (rope.freq_base_swa).
        rope_parameters={"full_attention": YARN_4X, "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
    ),
    spec(
        "granite",
        "granite",
        "Granite",
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.2,
        logits_scaling=8.0,
    ),
    spec(
        "granite-mqa-untied",
        "granite",
        "Granite",
        num_key_value_heads=1,
        tie_word_embeddings=False,
        embedding_multiplier=3.0,
        residual_multiplier=0.5,
        attention_multiplier=0.05,
        logits_scaling=2.0,
    ),
    # Granite MoE: the multipliers around renormalised top-k experts (transformers takes a softmax over
    # the chosen logits: the same weights).
    spec(
        "granitemoe",
        "granitemoe",
        "GraniteMoe",
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.2,
        logits_scaling=8.0,
    ),
    # Granite MoE Shared (the same GGUF architecture): a shared expert too; MQA, tied output, three layers.
    spec(
        "granitemoe-shared-mqa-tied",
        "granitemoe",
        "GraniteMoeShared",
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=1,
        num_local_experts=8,
        num_experts_per_tok=3,
        intermediate_size=32,
        shared_intermediate_size=48,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        embedding_multiplier=3.0,
        residual_multiplier=0.5,
        attention_multiplier=0.05,
        logits_scaling=2.0,
    ),
    # Phi-2: the converter writes head_count_kv = head_count (Phi-2 has no GQA) and a rotary part of
    # each head from partial_rotary_factor (0.5 here: 8 of 16 features); no rope_theta (always 10000).
    spec("phi2", "phi2", "Phi", num_key_value_heads=4),
    # 8 heads of 8, rotating 3/4 of each (6 features), three layers.
    spec(
        "phi2-rotary-3-4",
        "phi2",
        "Phi",
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
    ),
    # Rotating whole heads, 2 heads of 32. (No tied variant: the converter then writes output.bias
    # without output.weight, which llama.cpp refuses to load; every Phi-2 is untied.)
    spec(
        "phi2-full-rotary",
        "phi2",
        "Phi",
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
    ),
    # StableLM 3B 4E1T / Zephyr: a quarter of each head rotates (transformers' default), no biases.
    spec("stablelm", "stablelm", "StableLm"),
    # StableLM 2 1.6B: biased q, k, v; MHA, half of each head rotating, tied output. (The converter
    # writes no rope_theta: every StableLM uses 10000.)
    spec(
        "stablelm2-qkv-bias-tied",
        "stablelm",
        "StableLm",
        num_key_value_heads=4,
        use_qkv_bias=True,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    # StableLM 2 12B's attention and MLP in parallel from one norm, GQA 4:1. Not its per-head q/k
    # LayerNorms (qk_layernorm): the converter stops on them ("Unprocessed norms").
    spec(
        "stablelm2-parallel",
        "stablelm",
        "StableLm",
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        use_parallel_residual=True,
    ),
    spec("starcoder2", "starcoder2", "Starcoder2", use_bias=True, norm_epsilon=1e-5),
    spec("starcoder2-mqa-untied", "starcoder2", "Starcoder2", num_key_value_heads=1, tie_word_embeddings=False, rope_theta=100000.0),
    # Without biases on the projections and MLP (the LayerNorms keep theirs), heads wider than hidden / heads.
    spec("starcoder2-no-bias", "starcoder2", "Starcoder2", use_bias=False, head_dim=16, num_attention_heads=8, num_key_value_heads=4),
    spec("command-r", "command-r", "Cohere", logit_scale=0.25),
    # Command R+'s per-head q/k LayerNorms (llama.cpp loads them from 64 layers on; corral wherever they are).
    spec("command-r-qk-norm", "command-r", "Cohere", num_hidden_layers=3, use_qk_norm=True, logit_scale=0.5),
    # The command-r GGUF has no output tensor: Cohere's output is always tied.
    spec("command-r-mha-bias", "command-r", "Cohere", num_key_value_heads=4, attention_bias=True, rope_theta=10000.0, logit_scale=2.0),
    # Four layers: llama.cpp fixes cohere2's pattern at 3 sliding layers then 1 global.
    # rotary_pct: the converter reads it, transformers 5 no longer writes it (it stays in config.json).
    spec(
        "cohere2",
        "cohere2",
        "Cohere2",
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=4,
        logit_scale=0.25,
        rotary_pct=1.0,
    ),
    # Two global layers, MQA, another window and rope_theta.
    spec(
        "cohere2-mqa-8-layers",
        "cohere2",
        "Cohere2",
        num_hidden_layers=8,
        num_key_value_heads=1,
        sliding_window=6,
        rope_theta=50000.0,
        rotary_pct=1.0,
        logit_scale=1.5,
    ),
    # Four layers: every 4th has no RoPE.
    spec("smollm3", "smollm3", "SmolLM3", num_hidden_layers=4, tie_word_embeddings=True),
    # Five layers (only layer 3 without RoPE), heads wider than hidden / heads.
    spec(
        "smollm3-untied",
        "smollm3",
        "SmolLM3",
        num_hidden_layers=5,
        num_attention_heads=8,
        head_dim=16,
        tie_word_embeddings=False,
        rope_theta=2000000.0,
    ),
    spec(
        "gpt-oss",
        "gpt-oss",
        "GptOss",
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        sliding_window=4,
        max_position_embeddings=131072,
    ),
    spec(
        "gpt-oss-mqa",
        "gpt-oss",
        "GptOss",
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=3,
        sliding_window=6,
        max_position_embeddings=131072,
    ),
    # Tied output and a YaRN of its own (still unrounded, as every gpt-oss config says).
    spec(
        "gpt-oss-tied",
        "gpt-oss",
        "GptOss",
        num_local_experts=4,
        num_experts_per_tok=1,
        head_dim=16,
        intermediate_size=96,
        sliding_window=3,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        },
    ),
]

SPECS_BY_NAME = {spec.name: spec for spec in SPECS}
assert len(SPECS_BY_NAME) == len(SPECS), "spec names must be unique"


def pytest_params(check: str | None) -> list:
    """One pytest.param per spec for a test of `check`, marked `peers` and, where it fails today, xfail."""
    import pytest

    from corral.errors import UnknownArchitectureError

    params = []
    for spec in SPECS:
        marks = [pytest.mark.peers]
        if reason := spec.fails(check):
            raises = UnknownArchitectureError if reason == NOT_IMPLEMENTED else None
            marks.append(pytest.mark.xfail(strict=True, reason=reason, raises=raises))
        params.append(pytest.param(spec, id=f"ref-{spec.name}", marks=marks))
    return params


@attrs.frozen
class ConvertedReferences:
    """The driver's output folder: each spec's GGUF and transformers' logits."""

    root: pathlib.Path

    def gguf(self, spec: ReferenceSpec) -> pathlib.Path:
        """The converted file; the driver's traceback as an error where it failed or did not run."""
        error = self.root / spec.name / "error.txt"
        if error.is_file():
            raise RuntimeError(f"building or converting {spec.name} failed:\n{error.read_text()}")
        path = self.root / spec.name / "model.gguf"
        if not path.is_file():
            raise RuntimeError(f"{spec.name} was not converted in this session")
        return path

    def logits(self, spec: ReferenceSpec) -> tuple[list[int], np.ndarray]:
        """The ids and transformers' float32 logits [len(ids), vocab] on them."""
        self.gguf(spec)
        reference = np.load(self.root / spec.name / "reference.npz")
        return [int(i) for i in reference["ids"]], reference["logits"]


def convert(llama_cpp_dir: pathlib.Path, root: pathlib.Path, specs: list[ReferenceSpec]) -> ConvertedReferences:
    """Build and convert `specs` into `root` with one driver process (convert_driver.py)."""
    driver = pathlib.Path(__file__).with_name("convert_driver.py")
    command = [sys.executable, str(driver), str(llama_cpp_dir), str(root), *(spec.name for spec in specs)]
    # Everything is local: no hub look-ups (CI has no network), no progress bars in the captured output.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"convert_driver.py exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return ConvertedReferences(root)


# --- tokenizers ------------------------------------------------------------------------------------

SPECIAL = "<|endoftext|>"


def byte_level_merges(count: int) -> list[tuple[str, str]]:
    """`count` valid merges over GPT-2's byte-level alphabet: "Ġ" and common letters, then each merged
    token extended by each letter in turn (every new token is distinct, so any count works)."""
    letters = "etaoinshrdlucmfwypvbgk"
    merges: list[tuple[str, str]] = []
    prefixes = ["Ġ", *letters]
    for prefix in prefixes:
        for letter in letters:
            if len(merges) == count:
                return merges
            merges.append((prefix, letter))
            prefixes.append(prefix + letter)
    return merges


def write_bpe_tokenizer(folder, vocab_size: int) -> dict[str, int]:
    """A byte-level BPE tokenizer.json of exactly `vocab_size` tokens (the last one special); its config ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = byte_level_merges(vocab_size - 1 - len(vocab))
    for a, b in merges:
        vocab[a + b] = len(vocab)
    model = Tokenizer(models.BPE(vocab, merges))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.add_special_tokens([SPECIAL])
    PreTrainedTokenizerFast(tokenizer_object=model, bos_token=SPECIAL, eos_token=SPECIAL).save_pretrained(folder)
    special = vocab_size - 1
    assert sorted(model.get_vocab().values()) == list(range(vocab_size)) and model.token_to_id(SPECIAL) == special
    return {"bos_token_id": special, "eos_token_id": special, "pad_token_id": special}


def write_spm_tokenizer(folder, vocab_size: int) -> dict[str, int]:
    """A sentencepiece tokenizer.model (BPE with byte fallback) of exactly `vocab_size` pieces; its config ids."""
    import io
    import pathlib

    import sentencepiece

    rng = random.Random(0)  # a corpus with pieces enough for a few thousand merges; trained in ~0.1 s
    words = ["".join(rng.choice("etaoinshrdlucmfwypvbgkjqxz") for _ in range(rng.randint(2, 8))) for _ in range(2000)]
    sentences = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(1000)]
    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=proto,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    (pathlib.Path(folder) / "tokenizer.model").write_bytes(proto.getvalue())
    return {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # sentencepiece's <s>, </s>, <unk>


def write_gpt2_tokenizer(folder, vocab_size: int) -> dict[str, int]:
    """The byte-level BPE tokenizer saved as a GPT2Tokenizer, the class Phi-4's converter reads a tokenizer.json for."""
    import json
    import pathlib

    ids = write_bpe_tokenizer(folder, vocab_size)
    config_path = pathlib.Path(folder) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}, indent=2))
    return ids


TOKENIZER_WRITERS = {"bpe": write_bpe_tokenizer, "spm": write_spm_tokenizer, "gpt2": write_gpt2_tokenizer}
