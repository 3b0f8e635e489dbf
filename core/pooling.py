"""Pooling a batch's hidden states into one vector per input, and the vectors' normalisation.

The rows a forward pass returns depend on the pooling (`output_rows`): every row for mean pooling,
the first of each input for CLS, the last for last-token pooling (decoder embedding models such as
Qwen3-Embedding). Works on the torch tensors a backend's `compute` hands back (ml.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

POOLINGS = ("mean", "cls", "last")


def output_rows(lengths: Sequence[int], pooling: str) -> np.ndarray:
    """The batch rows the forward pass must return for `pooling`, inputs laid out one after another."""
    ends = np.cumsum(lengths, dtype=np.int64)
    if pooling == "mean":
        return np.arange(int(ends[-1]), dtype=np.int64)
    if pooling == "cls":
        return ends - np.asarray(lengths, dtype=np.int64)
    if pooling == "last":
        return ends - 1
    raise ValueError(f"unknown pooling {pooling!r}; corral pools by {', '.join(POOLINGS)}")


def pool(hidden: torch.Tensor, lengths: Sequence[int], pooling: str) -> torch.Tensor:
    """One float32 vector per input [inputs, dim] from the `output_rows` of the batch."""
    hidden = hidden.float()
    if pooling != "mean":
        return hidden
    if len(set(lengths)) == 1:
        return hidden.reshape(len(lengths), lengths[0], -1).mean(dim=1)
    return torch.stack([part.mean(dim=0) for part in hidden.split(list(lengths))])


def shorten(vectors: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """The first `dimensions` features of each vector (Matryoshka truncation); all of them when None or more."""
    return vectors if dimensions is None or dimensions >= vectors.shape[-1] else vectors[:, :dimensions]


def normalize(vectors: torch.Tensor) -> torch.Tensor:
    """Each vector scaled to unit L2 norm (sentence-transformers' Normalize, Ollama's /api/embed); zero stays zero."""
    return F.normalize(vectors, p=2.0, dim=-1)
