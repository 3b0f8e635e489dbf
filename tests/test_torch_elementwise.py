"""The torch backend's elementwise functions (plugins/backends/torch/elementwise.py): a row's bits
are the same alone and among any other rows, at any thread count and width, and the values are
torch's own to within a few units in the last place."""

from __future__ import annotations

import pytest
import torch

from corral.plugins.backends.torch import elementwise

FUNCTIONS = {
    "sigmoid": (elementwise.sigmoid, torch.sigmoid),
    "silu": (elementwise.silu, torch.nn.functional.silu),
    "gelu_tanh": (elementwise.gelu_tanh, lambda x: torch.nn.functional.gelu(x, approximate="tanh")),
    "gelu_erf": (elementwise.gelu_erf, torch.nn.functional.gelu),
    "tanh": (elementwise.tanh, torch.tanh),
    "cos": (elementwise.cos, torch.cos),
    "sin": (elementwise.sin, torch.sin),
}


def rows(count: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn((count, width), generator=torch.Generator().manual_seed(seed)) * 4


@pytest.mark.parametrize("torch_threads", [1, 2, 3, 4], indirect=True, ids=lambda n: f"threads{n}")
@pytest.mark.parametrize("width", [8, 576, 1000, 5632])
@pytest.mark.parametrize("name", FUNCTIONS)
def test_a_row_has_the_same_bits_alone_and_among_others(name, width, torch_threads):
    fn, _ = FUNCTIONS[name]
    count = max(3, 200_000 // width)  # past the size at which torch splits a call between threads
    x = rows(count, width, seed=width)
    together = fn(x)
    for row in (0, 1, count // 3, count // 2 + 1, count - 1):
        assert torch.equal(fn(x[row : row + 1]), together[row : row + 1]), row
        assert torch.equal(fn(x[row : row + 2]), together[row : row + 2]), row


@pytest.mark.parametrize("name", FUNCTIONS)
def test_values_are_torchs_within_a_few_ulps(name):
    fn, reference = FUNCTIONS[name]
    x = rows(37, 1000, seed=3)
    torch.testing.assert_close(fn(x), reference(x), rtol=2.4e-7, atol=4e-7)  # a couple of ulps; gelu near 0 a little more


def test_shape_dtype_and_strided_inputs_are_kept():
    x = rows(6, 40, seed=4)
    strided = x[:, ::2]  # not contiguous
    out = elementwise.silu(strided)
    assert out.shape == strided.shape and out.dtype == torch.float32
    assert torch.equal(out, elementwise.silu(strided.contiguous()))
    three = x.reshape(2, 3, 40)
    assert torch.equal(elementwise.sigmoid(three).reshape(6, 40), elementwise.sigmoid(x))
    assert elementwise.tanh(torch.empty((0, 8))).shape == (0, 8)
    half = x.bfloat16()
    assert elementwise.silu(half).dtype == torch.bfloat16
