"""The fields of GGUF quant blocks, read from bytes [n_blocks, type_size] with vectorised ops.

ggml lays its fields out little-endian at byte offsets that are often odd, so multi-byte words
are assembled from their bytes rather than viewed (a view needs aligned storage).
"""

from __future__ import annotations

import torch

QK_K = 256


def f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 stored at byte `start` of every block, as float32 [n_blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> codes [..., 2n]: all low nibbles, then all high nibbles (ggml's order)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def nibble_pairs(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> 4-bit fields [..., 2n]: each byte's low nibble, then its high one."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-1).flatten(-2)


def bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Bytes [..., n] -> their low `count` bits [..., n, count], bit 0 first."""
    shifts = torch.arange(count, dtype=torch.uint8)
    return (qh.unsqueeze(-1) >> shifts).bitwise_and_(1)


def crumbs(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """2-bit fields: bytes [n_blocks, groups * 32] -> [n_blocks, groups, 4, 32], bits 0-1 first."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    return (qs.reshape(-1, groups, 1, 32) >> shifts).bitwise_and_(3)


def words(qs: torch.Tensor, size: int) -> torch.Tensor:
    """Little-endian words of `size` (2 or 4) bytes: bytes [..., n * size] -> int32 [..., n].

    A 4-byte word's top bit lands in int32's sign: mask each field after shifting it down."""
    parts = qs.reshape(*qs.shape[:-1], -1, size).int()
    word = parts[..., 0].clone()
    for i in range(1, size):
        word.bitwise_or_(parts[..., i] << (8 * i))
    return word
