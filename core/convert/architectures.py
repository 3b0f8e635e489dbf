"""What differs between the architectures the converter knows: each family's GGUF architecture, the
hyperparameter keys beyond the common ones, and the few tensors it rewrites.

Learnt from llama.cpp's convert_hf_to_gguf.py (read, not copied); the tests prove each family's output
equal to that converter's on the same folder. A family is a class; `FAMILIES` maps the Hugging Face
architecture names of config.json ("LlamaForCausalLM", ...) to one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import gguf
import torch

from corral.convert.folder import ConvertError, HFFolder
from corral.convert.vocab import TOKENIZER_MODEL, add_json_vocab, add_spm_vocab, spm_pieces, write_spm_tokens


def first(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The value of the first of `keys` that config has."""
    return next((config[key] for key in keys if key in config), default)


class TextFamily:
    """A decoder whose settings and tensors map onto GGUF with the common keys and gguf's tensor names."""

    arch: gguf.MODEL_ARCH
    # Values written when config.json lacks the key (a family's published default).
    defaults: dict[str, Any] = {}

    def __init__(self, folder: HFFolder):
        self.folder = folder
        self.config = dict(folder.config)  # a family may drop or override a setting
        self.blocks = first(self.config, "num_hidden_layers", "n_layers", "n_layer", "num_layers")
        if self.blocks is None:
            raise ConvertError(f"config.json in {folder.path} says nothing of the layer count (num_hidden_layers)")
        self.tensor_map = gguf.get_tensor_name_map(self.arch, self.blocks)
        self.rope = self._rope_parameters()

    @property
    def arch_name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]

    def _rope_parameters(self) -> dict[str, Any]:
        """RoPE settings as transformers 5 keeps them (`rope_parameters`), older configs' top-level keys folded in."""
        rope = dict(first(self.config, "rope_parameters", "rope_scaling", default=None) or {})
        if "full_attention" in rope or "sliding_attention" in rope:
            return rope
        theta = first(self.config, "global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta", "rotary_emb_base")
        local = first(self.config, "local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta", "rope_local_base_freq")
        if local is not None:
            rope["sliding_attention"] = {"rope_theta": local}
        for key, value in (
            ("rope_theta", theta),
            ("rope_type", rope.get("type")),
            ("partial_rotary_factor", first(self.config, "partial_rotary_factor", "rope_pct", "rope_percent")),
            ("original_max_position_embeddings", self.config.get("original_max_position_embeddings")),
        ):
            if key not in rope and value is not None:
                rope[key] = value
        return rope

    def hparam(self, name: str, *keys: str) -> Any:
        return first(self.config, *keys, default=self.defaults.get(name))

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        """The hyperparameters every family writes when its config has them."""
        writer.add_block_count(self.blocks)
        keyed = (
            (writer.add_context_length, "context_length", ("max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length", "model_max_length")),
            (writer.add_embedding_length, "embedding_length", ("hidden_size", "n_embd", "dim")),
            (writer.add_feed_forward_length, "feed_forward_length", ("prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size", "n_inner", "hidden_dim")),
            (writer.add_head_count, "head_count", ("num_attention_heads", "n_head", "n_heads")),
            (writer.add_head_count_kv, "head_count_kv", ("num_key_value_heads", "n_kv_heads")),
        )
        for add, name, keys in keyed:
            if (value := self.hparam(name, *keys)) is not None:
                add(value)
        if self.config.get("is_causal") is False:
            writer.add_causal_attention(False)
        self.add_rope(writer)
        for add, name, keys in (
            (writer.add_layer_norm_rms_eps, "rms_eps", ("rms_norm_eps", "norm_eps")),
            (writer.add_layer_norm_eps, "norm_eps", ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")),
            (writer.add_expert_count, "experts", ("num_local_experts", "num_experts", "n_routed_experts")),
            (writer.add_expert_used_count, "experts_used", ("num_experts_per_tok", "num_experts_per_token", "top_k_experts")),
        ):
            if (value := self.hparam(name, *keys)) is not None:
                add(value)
        if (groups := self.config.get("n_group")) is not None:
            writer.add_expert_group_count(groups)
        if (groups_used := self.config.get("topk_group")) is not None:
            writer.add_expert_group_used_count(groups_used)
        scoring = first(self.config, "score_function", "scoring_func", "score_func", "moe_router_activation", "moe_router_activation_func", "expert_selection_fn")
        if scoring is not None:
            gating = {"sigmoid": gguf.ExpertGatingFuncType.SIGMOID, "softmax": gguf.ExpertGatingFuncType.SOFTMAX}
            if scoring not in gating:
                raise ConvertError(f"{self.folder.path}: expert scoring {scoring!r} does not convert (sigmoid or softmax)")
            writer.add_expert_gating_func(gating[scoring])
        if (head_dim := self.hparam("head_dim", "head_dim")) is not None:
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)

    def add_rope(self, writer: gguf.GGUFWriter) -> None:
        """RoPE's base and scaling (linear, YaRN, LongRoPE; Llama 3's becomes a rope_freqs tensor)."""
        rope = self.rope.get("full_attention", self.rope)
        kind, factor = rope.get("rope_type"), rope.get("factor")
        if kind == "linear" and factor is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(factor)
        elif kind == "yarn" and factor is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(factor)
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            for add, keys in (
                (writer.add_rope_scaling_yarn_ext_factor, ("extrapolation_factor",)),
                (writer.add_rope_scaling_yarn_attn_factor, ("attention_factor", "attn_factor")),
                (writer.add_rope_scaling_yarn_beta_fast, ("beta_fast",)),
                (writer.add_rope_scaling_yarn_beta_slow, ("beta_slow",)),
            ):
                if (value := first(rope, *keys)) is not None:
                    add(value)
        elif kind in ("su", "longrope"):
            writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        theta = rope.get("rope_theta", self.defaults.get("rope_theta"))
        if theta is not None:
            writer.add_rope_freq_base(theta)
        if (local := self.rope.get("sliding_attention", {}).get("rope_theta")) is not None:
            writer.add_rope_freq_base_swa(local)

    def extra_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors the family derives from the config (written first, already in GGUF names)."""
        return iter(())

    def add_vocab(self, writer: gguf.GGUFWriter) -> None:
        """The tokenizer keys, from tokenizer.json (llama.cpp's default for a family)."""
        add_json_vocab(writer, self.folder)

    def add_vocab_preferring_spm(self, writer: gguf.GGUFWriter) -> bool:
        """The tokenizer keys from a sentencepiece tokenizer.model where the folder has one, else tokenizer.json;
        True for the former."""
        if self.folder.has(TOKENIZER_MODEL):
            add_spm_vocab(writer, self.folder)
            return True
        add_json_vocab(writer, self.folder)
        return False

    def skip(self, name: str) -> bool:
        """Tensors GGUF has no place for (rotary caches, multimodal towers)."""
        return name.endswith((".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq"))

    def rename(self, name: str) -> str:
        """A folder's tensor name as gguf's TensorNameMap knows it."""
        return name.replace("language_model.", "").replace("e_score_correction_bias", "e_score_correction.bias")

    def modify(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor rewritten as llama.cpp stores it (float32 or float16 here)."""
        return tensor

    def tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The (folder-named) tensors one folder tensor becomes: itself, modified, unless a family regroups it."""
        yield name, self.modify(name, tensor)

    def finish(self) -> None:
        """Called after the last tensor: a family holding tensors back says which were never written."""

    def regroups(self, name: str) -> bool:
        """Whether `tensors` merges this folder tensor into another (so it has no GGUF name of its own)."""
        return False


EXPERT = re.compile(r"^(?P<layer>.*\.(?P<block>\d+)\..*\.experts)\.(?P<expert>\d+)\.(?P<kind>\w+)\.weight$")


class ExpertStacking(TextFamily):
    """Mixture-of-experts folders that keep one matrix per expert: GGUF stacks a layer's experts of each
    kind into one 3-D tensor, written (in `expert_kinds` order) once the layer's last expert is read."""

    expert_kinds: tuple[str, ...] = ()

    def __init__(self, folder: HFFolder):
        super().__init__(folder)
        self.experts = first(self.config, "num_local_experts", "num_experts", "n_routed_experts")
        self.pending: dict[str, dict[tuple[str, int], torch.Tensor]] = {}

    def tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        match = EXPERT.match(name)
        if match is None or match["kind"] not in self.expert_kinds:
            yield from super().tensors(name, tensor)
            return
        layer = self.pending.setdefault(match["layer"], {})
        layer[match["kind"], int(match["expert"])] = self.modify(name, tensor)
        if len(layer) == self.experts * len(self.expert_kinds):
            del self.pending[match["layer"]]
            for kind in self.expert_kinds:
                yield f"{match['layer']}.{kind}.weight", torch.stack([layer[kind, i] for i in range(self.experts)])

    def regroups(self, name: str) -> bool:
        match = EXPERT.match(name)
        return match is not None and match["kind"] in self.expert_kinds

    def finish(self) -> None:
        if self.pending:
            raise ConvertError(f"{self.folder.path}: experts missing from {', '.join(sorted(self.pending))}")

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        if (size := self.config.get("moe_intermediate_size")) is not None:
            writer.add_expert_feed_forward_length(size)
        if (size := self.config.get("shared_expert_intermediate_size")) is not None:
            writer.add_expert_shared_feed_forward_length(size)


class LlamaFamily(TextFamily):
    """Llama, Mistral: q and k rows permuted for ggml's RoPE on adjacent pairs; Llama 3's scaling as rope_freqs."""

    arch = gguf.MODEL_ARCH.LLAMA

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        writer.add_vocab_size(self.config["vocab_size"])
        writer.add_rope_dimension_count(self.head_dim())

    def add_vocab(self, writer: gguf.GGUFWriter) -> None:
        model = (self.folder.json("tokenizer.json") or {}).get("model") or {}
        if not self.folder.has(TOKENIZER_MODEL) and model.get("type") == "BPE" and model.get("byte_fallback"):
            raise ConvertError(
                f"{self.folder.path}: a sentencepiece-style tokenizer.json without its tokenizer.model does not convert yet"
            )
        if (prefix := (self.folder.json("tokenizer_config.json") or {}).get("add_prefix_space")) is not None:
            writer.add_add_space_prefix(prefix)
        self.add_vocab_preferring_spm(writer)
        if self.config.get("vocab_size") == 49152:  # llama.cpp's rule for Granite's small models (and SmolLM's vocabulary)
            writer.add_add_bos_token(False)

    def head_dim(self) -> int:
        return self.config.get("head_dim") or self.config["hidden_size"] // self.config["num_attention_heads"]

    def modify(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        heads = first(self.config, "n_heads", "num_attention_heads")
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return pair_rope_rows(tensor, heads)
        if name.endswith(("k_proj.weight", "k_proj.bias")):
            return pair_rope_rows(tensor, first(self.config, "n_kv_heads", "num_key_value_heads", default=heads))
        return tensor

    def extra_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        rope = self.rope.get("full_attention", self.rope)
        if str(rope.get("rope_type", "")).lower() == "llama3":
            yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", llama3_rope_factors(rope, self.head_dim())


def pair_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Each head's rows reordered from Hugging Face's rotate-halves layout to ggml's adjacent pairs:
    row i of the first half goes to 2i, row i of the second half to 2i + 1."""
    halves = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return halves.transpose(1, 2).reshape(weight.shape)


def llama3_rope_factors(rope: dict[str, Any], dim: int) -> torch.Tensor:
    """Llama 3.1's per-frequency divisors: high frequencies kept, low ones divided by `factor`, a smooth ramp between."""
    base = rope.get("rope_theta", 10000.0)
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    context = rope.get("original_max_position_embeddings", 8192)
    frequencies = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    wavelengths = 2 * math.pi / frequencies  # float32 throughout, as llama.cpp computes them
    smooth = (context / wavelengths - low) / (high - low)
    ramp = 1 / ((1 - smooth) / factor + smooth)
    factors = torch.where(wavelengths > context / low, torch.tensor(factor, dtype=torch.float32), ramp)
    return torch.where(wavelengths < context / high, torch.tensor(1.0, dtype=torch.float32), factors)


class SmolLM3Family(LlamaFamily):
    arch = gguf.MODEL_ARCH.SMOLLM3


class GraniteFamily(LlamaFamily):
    """Granite: llama with four multipliers; its head_dim is ignored, as llama.cpp does (heads are hidden / count)."""

    arch = gguf.MODEL_ARCH.GRANITE
    SCALES = (
        ("attention_multiplier", "add_attention_scale"),
        ("embedding_multiplier", "add_embedding_scale"),
        ("residual_multiplier", "add_residual_scale"),
        ("logits_scaling", "add_logit_scale"),
    )

    def __init__(self, folder: HFFolder):
        super().__init__(folder)
        self.config.pop("head_dim", None)

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        for key, add in self.SCALES:
            if value := self.config.get(key):
                getattr(writer, add)(value)


class GraniteMoeFamily(GraniteFamily):
    """Granite MoE (and MoE Shared): JetMoE's fused gate+up experts split in two, a shared MLP likewise."""

    arch = gguf.MODEL_ARCH.GRANITE_MOE

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        if size := self.config.get("shared_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(size)

    def tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        block = block_of(name)
        if name.endswith("block_sparse_moe.input_linear.weight"):
            gate, up = tensor.split(self.config["intermediate_size"], dim=-2)
            yield gguf_tensor(gguf.MODEL_TENSOR.FFN_GATE_EXP, block), gate
            yield gguf_tensor(gguf.MODEL_TENSOR.FFN_UP_EXP, block), up
        elif name.endswith("shared_mlp.input_linear.weight"):
            gate, up = tensor.split(self.config["shared_intermediate_size"], dim=-2)
            shared = bool(self.config.get("num_local_experts"))
            yield gguf_tensor(gguf.MODEL_TENSOR.FFN_GATE_SHEXP if shared else gguf.MODEL_TENSOR.FFN_GATE, block), gate
            yield gguf_tensor(gguf.MODEL_TENSOR.FFN_UP_SHEXP if shared else gguf.MODEL_TENSOR.FFN_UP, block), up
        elif name.endswith("shared_mlp.output_linear.weight") and not self.config.get("num_local_experts"):
            yield gguf_tensor(gguf.MODEL_TENSOR.FFN_DOWN, block), tensor
        else:
            yield from super().tensors(name, tensor)

    def regroups(self, name: str) -> bool:
        return name.endswith(("block_sparse_moe.input_linear.weight", "shared_mlp.input_linear.weight", "shared_mlp.output_linear.weight"))


def block_of(name: str) -> int | None:
    """The layer a tensor belongs to: the first all-digit part of its name."""
    return next((int(part) for part in name.split(".") if part.isdecimal()), None)


def gguf_tensor(kind: gguf.MODEL_TENSOR, block: int | None, suffix: str = ".weight") -> str:
    return gguf.TENSOR_NAMES[kind].format(bid=block) + suffix


class Starcoder2Family(TextFamily):
    arch = gguf.MODEL_ARCH.STARCODER2


class CommandRFamily(TextFamily):
    """Command R: the context of model_max_length where given (config.json's max_position_embeddings undersells it)."""

    arch = gguf.MODEL_ARCH.COMMAND_R

    def __init__(self, folder: HFFolder):
        super().__init__(folder)
        self.config["max_position_embeddings"] = first(self.config, "model_max_length", "max_position_embeddings")

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        writer.add_logit_scale(self.config["logit_scale"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)


class Cohere2Family(TextFamily):
    """Command R7B: sliding window, partial rotary, and no biases (its all-zero ones are dropped)."""

    arch = gguf.MODEL_ARCH.COHERE2

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        config = self.config
        writer.add_logit_scale(config["logit_scale"])
        writer.add_sliding_window(config["sliding_window"])
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(int(config["rotary_pct"] * (config["hidden_size"] // config["num_attention_heads"])))
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)

    def tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name.endswith(".bias"):
            if torch.any(tensor != 0):
                raise ConvertError(f"{self.folder.path}: {name} is not zero; llama.cpp's Command R7B has no biases")
            return
        yield from super().tensors(name, tensor)

    def regroups(self, name: str) -> bool:
        return name.endswith(".bias")


class Qwen2Family(TextFamily):
    arch = gguf.MODEL_ARCH.QWEN2

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        add_pooling(writer, self.folder)

    def add_vocab(self, writer: gguf.GGUFWriter) -> None:
        self.add_vocab_preferring_spm(writer)

    def rename(self, name: str) -> str:
        name = super().rename(name)
        return name if name.startswith(("model.", "lm_head")) else "model." + name  # a bare Qwen2Model's names


class Qwen3Family(Qwen2Family):
    arch = gguf.MODEL_ARCH.QWEN3


class MixtralFamily(ExpertStacking, LlamaFamily):
    """Mixtral: a llama file with experts (ffn_*_exps)."""

    expert_kinds = ("w1", "w2", "w3")


class Qwen2MoeFamily(ExpertStacking):
    arch = gguf.MODEL_ARCH.QWEN2MOE
    expert_kinds = ("down_proj", "gate_proj", "up_proj")


class Qwen3MoeFamily(Qwen2MoeFamily):
    arch = gguf.MODEL_ARCH.QWEN3MOE


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


def replace_key(writer: gguf.GGUFWriter, key: str) -> None:
    """Forget a key already written, so that a family's own value replaces the common one."""
    for data in writer.kv_data:
        data.pop(key, None)


class Gemma3Family(TextFamily):
    """Gemma 3: the norms' +1 folded into their weights, embedding rows past the tokenizer's dropped, SWA."""

    arch = gguf.MODEL_ARCH.GEMMA3
    defaults = {
        "context_length": 131072,
        "head_count": 8,
        "rms_eps": 1e-6,
        "head_dim": 256,
        "head_count_kv": 4,
        "rope_theta": 1_000_000.0,
    }

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        if self.config.get("attn_logit_softcapping") is not None:
            raise ConvertError("a Gemma 3 config with attn_logit_softcapping: Gemma 3 has none")
        if cap := self.config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(cap)
        if self.config.get("sliding_window_pattern") != 1:
            writer.add_sliding_window(self.config["sliding_window"])

    def add_vocab(self, writer: gguf.GGUFWriter) -> None:
        if self.add_vocab_preferring_spm(writer):
            writer.add_add_space_prefix(False)

    def modify(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if "embed_tokens.weight" in name and (rows := self.tokenizer_rows()) is not None:
            tensor = tensor[:rows]
        if name.endswith("norm.weight"):
            tensor = tensor + 1.0  # Gemma3RMSNorm multiplies by (1 + weight)
        return tensor

    def tokenizer_rows(self) -> int | None:
        """How many embedding rows the tokenizer uses (the rest, padding, is dropped); None without a tokenizer."""
        if self.folder.has(TOKENIZER_MODEL):
            from corral.convert.vocab import spm_token_list

            return len(spm_token_list(self.folder)[0])
        if self.folder.has("tokenizer.json"):
            tokenizer = self.folder.json("tokenizer.json")
            return len(tokenizer["model"]["vocab"]) + len(tokenizer.get("added_tokens", []))
        return None


class GemmaFamily(TextFamily):
    """Gemma (1): its own keys, sentencepiece only, norms +1, no output matrix; CodeGemma's fill-in-the-middle
    and end-of-turn ids as llama.cpp writes them for every Gemma (where gguf has keys for them)."""

    arch = gguf.MODEL_ARCH.GEMMA
    CODE_GEMMA_IDS = {"prefix": 67, "suffix": 69, "middle": 68, "fsep": 70, "eot": 107}

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        config = self.config
        writer.add_context_length(config["max_position_embeddings"])
        writer.add_embedding_length(config["hidden_size"])
        writer.add_block_count(self.blocks)
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_head_count(config["num_attention_heads"])
        writer.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])

    def add_vocab(self, writer: gguf.GGUFWriter) -> None:
        if not self.folder.has(TOKENIZER_MODEL):
            raise ConvertError(f"{self.folder.path} has no {TOKENIZER_MODEL}: a Gemma folder's tokenizer is read from it")
        add_spm_vocab(writer, self.folder)
        special = gguf.SpecialVocab(self.folder.path, load_merges=False, special_token_types=tuple(self.CODE_GEMMA_IDS))
        for kind, token in self.CODE_GEMMA_IDS.items():
            special.special_token_ids.setdefault(kind, token)  # the folder's own ids win
        special.chat_template = None  # written once, by add_spm_vocab
        special.add_to_gguf(writer, quiet=True)
        writer.add_add_space_prefix(False)

    def skip(self, name: str) -> bool:
        return super().skip(name) or name == "lm_head.weight"  # always tied; some exports carry a copy

    def modify(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + 1.0 if name.endswith("norm.weight") else tensor


class Gemma2Family(GemmaFamily):
    """Gemma 2: Gemma's keys and the soft caps and window; no CodeGemma ids."""

    arch = gguf.MODEL_ARCH.GEMMA2

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        writer.add_attn_logit_softcapping(self.config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(self.config["final_logit_softcapping"])
        writer.add_sliding_window(self.config["sliding_window"])

    def add_vocab(self, writer: gguf.GGUFWriter) -> None:
        if not self.folder.has(TOKENIZER_MODEL):
            raise ConvertError(f"{self.folder.path} has no {TOKENIZER_MODEL}: a Gemma 2 folder's tokenizer is read from it")
        add_spm_vocab(writer, self.folder)
        writer.add_add_space_prefix(False)


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


class Phi2Family(TextFamily):
    """Phi-2: MHA, partial rotary, feed-forward 4 x hidden, no BOS."""

    arch = gguf.MODEL_ARCH.PHI2

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        hidden, heads = first(self.config, "hidden_size", "n_embd"), first(self.config, "num_attention_heads", "n_head")
        writer.add_context_length(first(self.config, "n_positions", "max_position_embeddings"))
        writer.add_embedding_length(hidden)
        writer.add_feed_forward_length(4 * hidden)
        writer.add_block_count(self.blocks)
        writer.add_head_count(heads)
        writer.add_head_count_kv(heads)
        writer.add_layer_norm_eps(first(self.config, "layer_norm_epsilon", "layer_norm_eps"))
        writer.add_rope_dimension_count(int(self.rope["partial_rotary_factor"] * hidden) // heads)

    def add_vocab(self, writer: gguf.GGUFWriter) -> None:
        super().add_vocab(writer)
        writer.add_add_bos_token(False)


class Phi3Family(TextFamily):
    """Phi-3 and Phi-4: LongRoPE's factors as tensors with their attention factor, the sliding window (0 for
    none), a sentencepiece vocabulary whose added tokens are all user-defined unless special (Phi-4's GPT-2
    tokenizer is a BPE tokenizer.json)."""

    arch = gguf.MODEL_ARCH.PHI3

    def rope_dims(self) -> int:
        hidden, heads = first(self.config, "hidden_size", "n_embd"), first(self.config, "num_attention_heads", "n_head")
        return int(self.rope.get("partial_rotary_factor", 1.0) * hidden) // heads

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        config = self.config
        writer.add_context_length(first(config, "n_positions", "max_position_embeddings"))
        writer.add_rope_scaling_orig_ctx_len(self.rope["original_max_position_embeddings"])
        writer.add_embedding_length(first(config, "hidden_size", "n_embd"))
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_block_count(self.blocks)
        writer.add_head_count(first(config, "num_attention_heads", "n_head"))
        writer.add_head_count_kv(first(config, "num_key_value_heads", "n_head_kv"))
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
        writer.add_rope_dimension_count(self.rope_dims())
        writer.add_rope_freq_base(self.rope.get("full_attention", self.rope)["rope_theta"])
        writer.add_sliding_window(config.get("sliding_window") or 0)
        if self.rope.get("long_factor"):
            writer.add_rope_scaling_attn_factors(self.long_rope_attention_factor())

    def long_rope_attention_factor(self) -> float:
        original = self.rope["original_max_position_embeddings"]
        scale = first(self.config, "n_positions", "max_position_embeddings") / original
        kind = str(self.rope.get("rope_type", "")).lower()
        if kind in ("su", "longrope"):
            return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        if kind == "yarn":
            return 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
        raise ConvertError(f"{self.folder.path}: Phi-3 rope scaling {kind or 'without a type'} does not convert")

    def extra_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        long, short = self.rope.get("long_factor"), self.rope.get("short_factor")
        if not long:
            return
        if short is None or len(long) != len(short) or len(long) != self.rope_dims() / 2:
            raise ConvertError(f"{self.folder.path}: LongRoPE needs long and short factors of {self.rope_dims() // 2} values each")
        yield gguf_tensor(gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, None), torch.tensor(long, dtype=torch.float32)
        yield gguf_tensor(gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT, None), torch.tensor(short, dtype=torch.float32)

    def add_vocab(self, writer: gguf.GGUFWriter) -> None:
        if (self.folder.json("tokenizer_config.json") or {}).get("tokenizer_class") == "GPT2Tokenizer":
            add_json_vocab(writer, self.folder)
            return
        if not self.folder.has(TOKENIZER_MODEL):
            raise ConvertError(f"{self.folder.path} has no {TOKENIZER_MODEL}: a Phi-3 folder's tokenizer is read from it")
        tokens, scores, types = spm_pieces(self.folder)
        added = list((self.folder.json("tokenizer_config.json") or {}).get("added_tokens_decoder", {}).items())
        added += [(token["id"], token) for token in (self.folder.json("tokenizer.json") or {}).get("added_tokens", [])]
        for key, token in added:
            i = int(key)
            tokens[i], scores[i] = token["content"].encode(), -1000.0
            types[i] = gguf.TokenType.CONTROL if token.get("special") else gguf.TokenType.USER_DEFINED
        write_spm_tokens(writer, self.folder, tokens, scores, types)


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


class GptOssFamily(TextFamily):
    """gpt-oss in float weights: the experts' fused, interleaved gate/up split, their matrices transposed to
    GGUF's order, attention sinks named as weights. Its MXFP4 checkpoints (as released) do not convert yet."""

    arch = gguf.MODEL_ARCH.GPT_OSS

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        writer.add_sliding_window(self.config["sliding_window"])
        writer.add_expert_feed_forward_length(self.config["intermediate_size"])

    def rename(self, name: str) -> str:
        name = super().rename(name)
        return name + ".weight" if "sinks" in name else name

    def regroups(self, name: str) -> bool:
        return "down_proj" in name or "gate_up_proj" in name

    def tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name.endswith(("_blocks", "_scales")):
            raise ConvertError(f"{self.folder.path}: {name} is MXFP4; corral converts such folders of float weights only")
        if "down_proj" in name:
            if name.endswith("_bias"):
                yield name.replace("down_proj_bias", "down_proj.bias"), tensor
            else:
                yield name.replace("down_proj", "down_proj.weight"), tensor.transpose(-1, -2)
        elif "gate_up_proj" in name:
            if name.endswith("_bias"):
                yield name.replace("gate_up_proj_bias", "gate_proj.bias"), tensor[..., ::2]
                yield name.replace("gate_up_proj_bias", "up_proj.bias"), tensor[..., 1::2]
            else:
                fused = tensor.transpose(-1, -2)
                yield name.replace("gate_up_proj", "gate_proj.weight"), fused[:, ::2, :]
                yield name.replace("gate_up_proj", "up_proj.weight"), fused[:, 1::2, :]
        else:
            yield from super().tensors(name, tensor)


class BertFamily(TextFamily):
    """BERT encoders (sentence-transformers' MiniLM, bge): not causal, token types, the pooling of modules.json."""

    arch = gguf.MODEL_ARCH.BERT

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        writer.add_causal_attention(False)
        add_pooling(writer, self.folder)

    def skip(self, name: str) -> bool:
        name = self.rename(name)
        return (
            super().skip(name)
            or name in ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")
            or name.startswith(("cls.predictions", "cls.seq_relationship"))
        )

    def rename(self, name: str) -> str:
        name = name.removeprefix("bert.")
        if name.endswith(".gamma"):
            name = name.removesuffix(".gamma") + ".weight"
        if name.endswith(".beta"):
            name = name.removesuffix(".beta") + ".bias"
        return name


POOLING = {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS, "lasttoken": gguf.PoolingType.LAST}


def add_pooling(writer: gguf.GGUFWriter, folder: HFFolder) -> None:
    """The pooling of a sentence-transformers folder (modules.json's Pooling module), when it has one."""
    modules = folder.json("modules.json")
    pooling = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None) if isinstance(modules, list) else None
    if pooling is None:
        return
    settings = folder.json(f"{pooling['path']}/config.json")
    flags = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "lasttoken": "pooling_mode_lasttoken"}
    mode = next((mode for mode, flag in flags.items() if settings.get(flag)), settings.get("pooling_mode"))
    if mode not in POOLING:
        raise ConvertError(f"{folder.path}: only mean, CLS and last-token pooling convert, not {mode}")
    writer.add_pooling_type(POOLING[mode])


FAMILIES: dict[str, type[TextFamily]] = {
    "LlamaForCausalLM": LlamaFamily,
    "MistralForCausalLM": LlamaFamily,
    "MixtralForCausalLM": MixtralFamily,
    "Qwen2MoeForCausalLM": Qwen2MoeFamily,
    "Qwen3MoeForCausalLM": Qwen3MoeFamily,
    "OlmoeForCausalLM": OlmoeFamily,
    "Olmo2ForCausalLM": Olmo2Family,
    "Olmo3ForCausalLM": Olmo2Family,
    "SmolLM3ForCausalLM": SmolLM3Family,
    "GraniteForCausalLM": GraniteFamily,
    "GraniteMoeForCausalLM": GraniteMoeFamily,
    "GraniteMoeSharedForCausalLM": GraniteMoeFamily,
    "Starcoder2ForCausalLM": Starcoder2Family,
    "CohereForCausalLM": CommandRFamily,
    "Cohere2ForCausalLM": Cohere2Family,
    "GemmaForCausalLM": GemmaFamily,
    "Gemma2ForCausalLM": Gemma2Family,
    "StableLmForCausalLM": StableLMFamily,
    "StableLMEpochForCausalLM": StableLMFamily,
    "PhiForCausalLM": Phi2Family,
    "GptOssForCausalLM": GptOssFamily,
    "DeepseekV2ForCausalLM": DeepSeekFamily,
    "DeepseekV3ForCausalLM": DeepSeekFamily,
    "Phi3ForCausalLM": Phi3Family,
    "Qwen2ForCausalLM": Qwen2Family,
    "Qwen2Model": Qwen2Family,
    "Qwen3ForCausalLM": Qwen3Family,
    "Qwen3Model": Qwen3Family,
    "Gemma3ForCausalLM": Gemma3Family,
    "BertModel": BertFamily,
    "BertForMaskedLM": BertFamily,
}


def family_of(folder: HFFolder) -> TextFamily:
    """The family of config.json's `architectures`; a ConvertError listing the known ones otherwise."""
    names = folder.config.get("architectures") or []
    for name in names:
        if name in FAMILIES:
            return FAMILIES[name](folder)
    given = ", ".join(map(str, names)) or "none"
    raise ConvertError(
        f"{folder.path}: cannot convert architecture {given} (config.json's `architectures`); "
        f"corral converts {', '.join(sorted(FAMILIES))}"
    )
