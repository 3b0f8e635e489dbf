"""What every converted architecture shares: the common GGUF keys, RoPE settings, tensor renaming, the
stacking of per-expert matrices and sentence-transformers pooling. Families (corral.convert.families)
say only what differs; learnt from llama.cpp's convert_hf_to_gguf.py (read, not copied)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import gguf
import torch

from corral.convert.folder import ConvertError, HFFolder
from corral.convert.vocab import TOKENIZER_MODEL, add_json_vocab, add_spm_vocab

# config.json's names for one setting, in the order llama.cpp looks for them.
CONTEXT_KEYS = ("max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length", "model_max_length")
FEED_FORWARD_KEYS = ("prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size", "n_inner", "hidden_dim")
# The vision side of a multimodal folder (Gemma3ForConditionalGeneration, LlavaForConditionalGeneration), with or
# without the `model.` of some transformers releases.
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
SCORING_KEYS = (
    "score_function", "scoring_func", "score_func", "moe_router_activation", "moe_router_activation_func", "expert_selection_fn"
)


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
            (writer.add_context_length, "context_length", CONTEXT_KEYS),
            (writer.add_embedding_length, "embedding_length", ("hidden_size", "n_embd", "dim")),
            (writer.add_feed_forward_length, "feed_forward_length", FEED_FORWARD_KEYS),
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
        self.add_routing(writer)
        if (head_dim := self.hparam("head_dim", "head_dim")) is not None:
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)

    def add_routing(self, writer: gguf.GGUFWriter) -> None:
        """Mixture-of-experts routing: expert groups and the gating function."""
        if (groups := self.config.get("n_group")) is not None:
            writer.add_expert_group_count(groups)
        if (groups_used := self.config.get("topk_group")) is not None:
            writer.add_expert_group_used_count(groups_used)
        scoring = first(self.config, *SCORING_KEYS)
        if scoring is not None:
            gating = {"sigmoid": gguf.ExpertGatingFuncType.SIGMOID, "softmax": gguf.ExpertGatingFuncType.SOFTMAX}
            if scoring not in gating:
                raise ConvertError(f"{self.folder.path}: expert scoring {scoring!r} does not convert (sigmoid or softmax)")
            writer.add_expert_gating_func(gating[scoring])

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
        """Tensors GGUF has no place for (rotary caches), and a vision model's tower, which corral.convert.projector writes."""
        return name.endswith((".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")) or name.startswith(VISION_PREFIXES)

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


def block_of(name: str) -> int | None:
    """The layer a tensor belongs to: the first all-digit part of its name."""
    return next((int(part) for part in name.split(".") if part.isdecimal()), None)


def gguf_tensor(kind: gguf.MODEL_TENSOR, block: int | None, suffix: str = ".weight") -> str:
    return gguf.TENSOR_NAMES[kind].format(bid=block) + suffix


def replace_key(writer: gguf.GGUFWriter, key: str) -> None:
    """Forget a key already written, so that a family's own value replaces the common one."""
    for data in writer.kv_data:
        data.pop(key, None)


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
