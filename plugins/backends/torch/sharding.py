"""A tensor-parallel rank's part of a GGUF tensor, cut from the file's bytes before any conversion.

GGUF stores a matrix as rows of whole quantization blocks, so a rank's output rows are a slice of
the file's rows, and its input columns a slice of each row's blocks whenever the cut falls on a
block boundary (for every split of real models: heads and feed-forward widths are multiples of 32
and 256). The part then goes through the same layout choice as a whole tensor. A cut inside a
block is dequantized to float32 first.
"""

from __future__ import annotations

import attrs
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from corral.gguf import TensorInfo
from corral.parallel.shards import Shard, TensorParallelError
from corral.plugins.backends.torch.dequantize import dequantize


def shard_tensor(raw: torch.Tensor, info: TensorInfo, shard: Shard) -> tuple[torch.Tensor, TensorInfo]:
    """The bytes [rows, row_bytes] and description of `shard` of the tensor `info` whose bytes are `raw`."""
    name = f"{info.name}[{shard.axis} {shard.index + 1}/{shard.parts}]"  # its own key in the backend's dense cache
    vector = len(info.shape) == 1
    length = info.shape[0] if shard.axis == "rows" and not vector else info.shape[-1]
    if length % shard.parts:
        raise TensorParallelError(f"tensor '{info.name}' of shape {list(info.shape)} does not split into {shard.parts} equal parts")
    start, stop = shard.bounds(length)
    if shard.axis == "rows" and not vector:
        part = raw[start:stop]
        return part, attrs.evolve(info, name=name, shape=(stop - start, *info.shape[1:]), nbytes=part.numel())
    block, type_size = GGML_QUANT_SIZES[info.qtype]
    if (stop - start) % block:  # the cuts fall inside blocks: cut the float values instead
        values = dequantize(raw, info.qtype, info.shape[-1], dtype=torch.float32)[:, start:stop].contiguous()
        part = values.view(torch.uint8).reshape(values.shape[0], -1)
        return part, attrs.evolve(info, name=name, shape=(*info.shape[:-1], stop - start), qtype=Q.F32, nbytes=part.numel())
    part = raw[:, start // block * type_size : stop // block * type_size].contiguous()
    return part, attrs.evolve(info, name=name, shape=(*info.shape[:-1], stop - start), nbytes=part.numel())
