"""Which type each tensor gets under a preset, as llama-quantize chooses it (src/llama-quant.cpp).

The rules for the presets corral makes, in llama.cpp's order:

* only weights of two or more dimensions are quantized, never norms, MoE routers, position or token
  type embeddings (and a few small tensors of architectures corral does not run);
* the output projection, or the token embedding when the output reuses it, gets Q6_K (Q8_0 when its
  rows are not a multiple of the preset's block, or when the preset is Q8_0);
* Q4_K_M and Q5_K_M give Q6_K to the attention value projections and FFN down projections of the
  layers `use_more_bits` picks (the first and last eighth, and every third in between); Q4_K_S gives
  Q5_K to the first four value projections and to the down projections of the first eighth;
* 8-expert models get Q8_0 value/key projections and Q5_K attention outputs under Q4_K_S/M; a 70B
  llama (80 layers, grouped-query attention) gets Q5_K value projections for Q4_K;
* a tensor whose rows are not a multiple of the chosen type's block falls back (Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0, then F16).

Counting matters: llama.cpp numbers value projections and down projections in the order it visits
the tensors, sorted by layer then by name, so they are visited in that order here too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import attrs
from gguf import GGML_QUANT_SIZES, MODEL_ARCH, MODEL_ARCH_NAMES
from gguf import GGMLQuantizationType as Q

from corral.quantize.presets import Preset

# Substrings of weight names llama.cpp never quantizes (tensor_allows_quantization).
_KEPT = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight", "time_mix_first.weight",
    "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight",
    "time_mix_v2.weight", "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight",
    "time_mix_g2.weight", "time_mix_decay_w1.weight", "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight",
    "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd",
    ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
)
_KEPT_NAMES = frozenset({"position_embd.weight", "token_types.weight"})
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
_LAYER = re.compile(r"blk\.(\d+)\.")


@attrs.frozen
class ModelShape:
    """What of a model's hyperparameters the type choice reads."""

    architecture: str
    block_count: int
    head_count: int = 0
    head_count_kv: int = 0
    expert_count: int = 0

    @property
    def is_70b(self) -> bool:
        """llama.cpp's LLM_TYPE_70B, as its quantizer infers it (llama with 80 layers and GQA; qwen2 with 80)."""
        if self.block_count != 80:
            return False
        # The file format's own architecture names (gguf-py's table, as llama.cpp's loader has them).
        if self.architecture == MODEL_ARCH_NAMES[MODEL_ARCH.QWEN2]:
            return True
        return self.architecture == MODEL_ARCH_NAMES[MODEL_ARCH.LLAMA] and self.head_count != self.head_count_kv


@attrs.frozen
class TensorShape:
    """A tensor as the type choice sees it: name, shape (outermost first) and current type."""

    name: str
    shape: tuple[int, ...]
    qtype: Q


def category(name: str) -> str:
    """llama.cpp's broad tensor category (tensor_get_category), by name."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, kind in (
        ("attn_qkv.weight", "attn_v"),  # the fused and MLA value projections count as attn_v
        ("attn_kv_b.weight", "attn_v"),
        ("attn_v.weight", "attn_v"),
        ("attn_k.weight", "attn_k"),
        ("attn_q.weight", "attn_q"),
        ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"),
        ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):
        if part in name:
            return kind
    return "other"


def allows_quantization(tensor: TensorShape) -> bool:
    """Whether llama-quantize converts this tensor at all (others are copied as they are)."""
    dims = list(tensor.shape)
    while len(dims) > 1 and dims[0] == 1:  # ggml counts dimensions without the outer ones of size 1
        dims.pop(0)
    if len(dims) < 2 or not tensor.name.endswith("weight") or tensor.name in _KEPT_NAMES:
        return False
    return not any(part in tensor.name for part in _KEPT)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: first and last eighth, every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def llama_order(tensors: Iterable[TensorShape]) -> list[TensorShape]:
    """The order llama.cpp's model loader visits tensors in: by layer (non-layer tensors first), then name."""

    def key(tensor: TensorShape) -> tuple[int, bytes]:
        match = _LAYER.match(tensor.name)
        return (int(match.group(1)) if match else -1, tensor.name.encode())

    return sorted(tensors, key=key)


def block_size(qtype: Q) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def fallback(tensor: TensorShape, qtype: Q) -> Q:
    """A type whose block fits the tensor's rows: llama.cpp's tensor_type_fallback."""
    columns = tensor.shape[-1]
    if columns % block_size(qtype) == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, qtype)
    return qtype if columns % block_size(qtype) == 0 else Q.F16


def tensor_types(model: ModelShape, tensors: Iterable[TensorShape], preset: Preset) -> dict[str, Q]:
    """Each tensor's type in the quantized file, by name."""
    ordered = llama_order(tensors)
    chooser = _Chooser(model, preset, ordered)
    return {tensor.name: chooser.choose(tensor) for tensor in ordered}


class _Chooser:
    """llama_tensor_get_type's state: how many value and down projections it has seen."""

    def __init__(self, model: ModelShape, preset: Preset, tensors: list[TensorShape]):
        self.model, self.preset = model, preset
        self.name = preset.name
        self.tied = not any(t.name == "output.weight" for t in tensors)
        self.n_attn_v = sum(category(t.name) == "attn_v" for t in tensors)
        self.i_attn_v = 0
        self.i_ffn_down = 0

    def choose(self, tensor: TensorShape) -> Q:
        if not allows_quantization(tensor):
            return tensor.qtype
        return fallback(tensor, self._by_role(tensor, category(tensor.name)))

    def _by_role(self, tensor: TensorShape, kind: str) -> Q:
        qtype, name, experts = self.preset.default_type, self.name, self.model.expert_count
        if kind == "output" or (self.tied and kind == "token_embd"):
            if tensor.shape[-1] % block_size(qtype) != 0:
                return Q.Q8_0
            return qtype if qtype == Q.Q8_0 else Q.Q6_K
        if kind == "attn_v":
            if name in ("Q4_K_M", "Q5_K_M") and use_more_bits(self.i_attn_v, self.n_attn_v):
                qtype = Q.Q6_K
            elif name == "Q4_K_S" and self.i_attn_v < 4:
                qtype = Q.Q5_K
            if self.model.is_70b and qtype == Q.Q4_K:
                qtype = Q.Q5_K
            if experts == 8:
                qtype = Q.Q8_0
            self.i_attn_v += 1
        elif kind == "attn_k":
            if experts == 8:
                qtype = Q.Q8_0
        elif kind == "ffn_down":
            layer, layers = self._layer(tensor.name)
            if name in ("Q4_K_M", "Q5_K_M") and use_more_bits(layer, layers):
                qtype = Q.Q6_K
            elif name == "Q4_K_S" and layer < layers // 8:
                qtype = Q.Q5_K
            self.i_ffn_down += 1
        elif kind == "attn_output":
            if experts == 8 and name in ("Q4_K_S", "Q4_K_M"):
                qtype = Q.Q5_K
        return qtype

    def _layer(self, name: str) -> tuple[int, int]:
        """The layer of a down projection: its count so far, or for MoE models (several per layer) its name."""
        if self.model.expert_count > 1 and (match := _LAYER.match(name)):
            return int(match.group(1)), self.model.block_count
        return self.i_ffn_down, self.model.block_count
