"""The torch backend's KV cache buffers: a float tensor, or ggml's 8- and 4-bit blocks (q8_0, q4_0).

A buffer is [kv_heads, cells, dim]. A quantized one keeps, per cell and head, `dim / 32` blocks of
32 codes and one float16 scale, as ggml's q8_0 (int8 codes, x = d * q) and q4_0 (4-bit codes two a
byte, the block's first 16 values in the low nibbles, x = d * (q - 8)) lay them out: 34 and 18 bytes
per 32 values, against 64 in bfloat16. Rows are quantized as they are written into their cells, as
ggml's reference quantizers round them (gguf.quants gives the same bytes); attention dequantizes
only the cells it reads, into a temporary float tensor, so no float copy of the cache is kept.

Every value's codes depend only on its own block and its dequantized value only on its codes and
scale, so a sequence's cells read back with the same bits whatever else is in the batch.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

BLOCK = 32  # values per block in both layouts
CODE_BYTES = {"q8_0": 1.0, "q4_0": 0.5}  # bytes a value's code takes; each block adds a 2-byte scale


class QuantizedCells:
    """A quantized cache buffer: `codes` [kv_heads, cells, dim * CODE_BYTES] and `scales` [kv_heads, cells, dim / 32]
    float16; read back in `dtype`."""

    def __init__(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        heads, cells, dim = shape
        if (reason := refusal(kind, shape)) is not None:
            raise ValueError(reason)
        self.kind, self.shape, self.dtype, self.device = kind, tuple(shape), dtype, device
        code_dtype, code_dim = (torch.int8, dim) if kind == "q8_0" else (torch.uint8, dim // 2)
        self.codes = torch.zeros((heads, cells, code_dim), dtype=code_dtype, device=device)
        self.scales = torch.zeros((heads, cells, dim // BLOCK), dtype=torch.float16, device=device)

    @staticmethod
    def nbytes_of(kind: str, shape: tuple[int, ...]) -> int:
        """Bytes a buffer of this kind and shape occupies."""
        heads, cells, dim = shape
        return int(heads * cells * (dim * CODE_BYTES[kind] + 2 * (dim // BLOCK)))

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def write(self, cells: Any, rows: torch.Tensor) -> None:
        """Quantize rows [n, kv_heads, dim] into their cells (a slice or an int64 index)."""
        codes, scales = (quantize_q8_0 if self.kind == "q8_0" else quantize_q4_0)(rows.transpose(0, 1))
        store(self.codes, cells, codes)
        store(self.scales, cells, scales)

    def read(self, select: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The cells `select` picks out of a [kv_heads, cells, ...] tensor (applied to the codes and to the
        scales alike), dequantized: [..., dim] in `dtype`."""
        codes, scales = select(self.codes), select(self.scales)
        if self.kind == "q4_0":
            low, high = (codes & 0x0F).unflatten(-1, (-1, BLOCK // 2)), (codes >> 4).unflatten(-1, (-1, BLOCK // 2))
            values = torch.cat((low, high), dim=-1).to(torch.int8) - 8
        else:
            values = codes.unflatten(-1, (-1, BLOCK))
        return (values.float() * scales.float().unsqueeze(-1)).flatten(-2).to(self.dtype)


def refusal(kind: str, shape: tuple[int, ...]) -> str | None:
    """Why a `kind` buffer cannot have `shape` [kv_heads, cells, dim], or None when it can."""
    dim = shape[-1]
    if dim % BLOCK:
        return f"a {kind} KV cache needs head dims that are a multiple of {BLOCK}; this model's is {dim}"
    return None


def store(buffer: torch.Tensor, cells: Any, new: torch.Tensor) -> None:
    """Put new [heads, n, ...] into cells (a slice or an int64 index) of buffer [heads, cells, ...], converting as it copies."""
    if isinstance(cells, slice):
        buffer[:, cells].copy_(new)
    else:
        buffer.index_copy_(1, cells, new.to(buffer.dtype))


def write_cells(buffer: Any, cells: Any, rows: torch.Tensor) -> None:
    """Store rows [n, heads, dim] into cache cells (a slice or an index) of a float or quantized buffer."""
    if isinstance(buffer, QuantizedCells):
        buffer.write(cells, rows)
    else:
        store(buffer, cells, rows.transpose(0, 1))


def read_cells(buffer: Any, select: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`select` of a float buffer (a view where it can be one), or of a quantized one's codes and scales, dequantized."""
    return buffer.read(select) if isinstance(buffer, QuantizedCells) else select(buffer)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.float().unflatten(-1, (-1, BLOCK))


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (ties away from zero), which ggml rounds with; torch.round rounds ties to even."""
    rounded = torch.round(x)
    ties = (x - torch.trunc(x)).abs() == 0.5
    return torch.where(ties, torch.trunc(x) + torch.sign(x), rounded)


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's q8_0 of x [..., dim]: int8 codes [..., dim] and float16 scales [..., dim / 32]."""
    blocks = _blocks(x)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    codes = _round_half_away(blocks * inverse).to(torch.int8)
    return codes.flatten(-2), d.squeeze(-1).to(torch.float16)


def quantize_q4_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's q4_0 of x [..., dim]: codes two a byte [..., dim / 2] and float16 scales [..., dim / 32].

    The scale maps the block's value of largest magnitude (the first, on a tie) to -8, so that
    value is exact and the others round into -8..7."""
    blocks = _blocks(x)
    extreme = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
    d = extreme / -8
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    codes = torch.trunc(blocks * inverse + 8.5).clamp(0, 15).to(torch.uint8)
    packed = codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2 :] << 4)
    return packed.flatten(-2), d.squeeze(-1).to(torch.float16)
