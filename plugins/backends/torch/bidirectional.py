"""The torch backend's encoder attention: every row attends to all rows of its own sequence, no cache.

Sequences of one length (a lone input, a batch of equal lengths) are one SDPA call over a
[sequences, heads, length, dim] view; sequences of several lengths are padded to the longest and
masked, which costs the padding but keeps one kernel call per layer whatever the batch.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int], scale: float) -> torch.Tensor:
    """q, k, v [n, heads, dim] as consecutive runs of `lengths` rows -> [n, heads * dv]."""
    n, heads = q.shape[0], q.shape[1]
    gqa = heads != k.shape[1]
    # float32 on the CPU: faster there than bf16 for prompt-sized runs, and an encoder's output is its result.
    dtype = torch.float32 if q.device.type == "cpu" else q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    count, longest = len(lengths), max(lengths)
    if all(length == longest for length in lengths):
        out = F.scaled_dot_product_attention(_runs(q, count, longest), _runs(k, count, longest), _runs(v, count, longest), scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(n, -1)
    rows = _padded_rows(lengths, longest, q.device)
    mask = (torch.arange(longest, device=q.device)[None, :] < torch.tensor(lengths, device=q.device)[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        _padded(q, rows, count, longest), _padded(k, rows, count, longest), _padded(v, rows, count, longest), attn_mask=mask, scale=scale, enable_gqa=gqa
    )
    return out.transpose(1, 2).reshape(count * longest, heads, -1)[rows].reshape(n, -1)


def _runs(x: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """[n, heads, dim] as [count, heads, length, dim] (a view)."""
    return x.reshape(count, length, x.shape[1], x.shape[2]).transpose(1, 2)


def _padded_rows(lengths: Sequence[int], longest: int, device: torch.device) -> torch.Tensor:
    """Where each row goes in the padded [count * longest] layout."""
    starts = [i * longest for i in range(len(lengths))]
    return torch.cat([torch.arange(start, start + length, device=device) for start, length in zip(starts, lengths)])


def _padded(x: torch.Tensor, rows: torch.Tensor, count: int, longest: int) -> torch.Tensor:
    """[n, heads, dim] scattered into zeros [count, heads, longest, dim]."""
    out = x.new_zeros((count * longest, x.shape[1], x.shape[2]))
    out[rows] = x
    return out.reshape(count, longest, x.shape[1], x.shape[2]).transpose(1, 2)
