"""Elementwise functions whose bits do not depend on the batch: sigmoid, silu, gelu, tanh, cos, sin.

torch's CPU kernels for these run most elements through vectorized (SLEEF) code and a loop's tail,
fewer than two vectors of elements, through the scalar libm function, whose last bit can differ;
and a tensor above ATen's grain size is split between threads at element counts that fall
anywhere in a row. So a row's bits depended on how many rows came before it, on its width and on
the thread count: a router of 8 experts (deepseek2's sigmoid) differed in the last row of a prompt
alone and the same prompt batched at 1, 3 or 4 threads, and silu on rows of 1000 at 2 threads.

Here every element takes the vector path: the tensor, flattened, is padded to whole blocks and run
in slices below the grain size, each one serial. On CUDA an element's result does not depend on
its neighbours, so the function runs as it is.
"""

from __future__ import annotations

from typing import Callable

import torch

# Elements: a whole number of two-vector steps at every vector width ATen's CPU loops use (AVX2's
# 8 floats, AVX-512's 16, bf16's 32), so no element is left to the scalar tail.
BLOCK = 64
# Elements a call: below ATen's grain size (32768), under which a kernel runs on one thread.
SLICE = 16384


def invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, each element computed the same way whatever the tensor around it."""
    if x.device.type != "cpu":
        return fn(x)
    count = x.numel()
    if count % BLOCK == 0 and count <= SLICE and x.is_contiguous():
        return fn(x)  # the common decode case: one serial call without a tail
    padded = -(-count // BLOCK) * BLOCK
    flat = x.new_zeros(padded)
    flat[:count] = x.reshape(-1)
    out = torch.cat([fn(flat[start : start + SLICE]) for start in range(0, padded, SLICE)])
    return out[:count].view(x.shape)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return invariant(torch.sigmoid, x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return invariant(torch.nn.functional.silu, x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return invariant(_gelu_tanh, x)


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    return invariant(torch.nn.functional.gelu, x)


def tanh(x: torch.Tensor) -> torch.Tensor:
    return invariant(torch.tanh, x)


def cos(x: torch.Tensor) -> torch.Tensor:
    return invariant(torch.cos, x)


def sin(x: torch.Tensor) -> torch.Tensor:
    return invariant(torch.sin, x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")
