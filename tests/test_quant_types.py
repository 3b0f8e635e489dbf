"""Every quant type gguf-py reads beyond the k-quants: a tiny model of it loads compact and gives
the logits of its float32 reference (the same file with gguf's dequantization of every tensor)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from tiny_gguf import VOCAB_SIZE, write_dequantized_copy, write_tensors, write_tiny_llama

import corral
from corral.errors import UnsupportedTensorTypeError
from corral.gguf import GGUFFile
from corral.plugins.backends.torch import TorchBackend, dequantize_iq
from corral.plugins.backends.torch.backend import predicted_bytes
from corral.plugins.backends.torch.dequantize import DEQUANTIZERS
from corral.plugins.backends.torch.layouts import Int8Weight, MappedRows, RescoredLogits

Q = gguf.GGMLQuantizationType
TYPES = list(dequantize_iq.DEQUANTIZERS)
# Widths that every block size divides (256 values at most).
SIZES = {"embedding_length": 256, "feed_forward_length": 256}
LINEARS = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
TOKENS = [int(t) for t in np.random.default_rng(7).integers(0, VOCAB_SIZE, 9)]
# Of the logits' scale. Every linear here is of the type, requantized to int8 rows and fed bf16
# activations: the logits moved by up to 3.4% of their scale (MXFP4), where test_conformance's
# models, mostly F32, stay within 3%.
AUTO_TOLERANCE = 5e-2


@pytest.fixture(scope="module", params=TYPES, ids=lambda q: q.name)
def files(request, tmp_path_factory) -> tuple[Q, str, str]:
    """(type, a tiny llama whose linears and tied embedding are of it, its float32 reference)."""
    qtype = request.param
    folder = tmp_path_factory.mktemp(qtype.name)
    types = {f"blk.{i}.{name}.weight": qtype for i in range(2) for name in LINEARS}
    path = write_tiny_llama(
        folder / "tiny.gguf",
        tensor_types={**types, "token_embd.weight": qtype},
        **SIZES,
    )
    return qtype, path, write_dequantized_copy(path, folder / "f32.gguf")


@pytest.fixture(scope="module")
def expected_logits(files) -> np.ndarray:
    """The float32 reference's logits of TOKENS: computed once per type, for both logits tests."""
    return corral.load_model(files[2], precision="fp32").logits(TOKENS)


def test_each_role_loads_into_a_compact_layout(files):
    qtype, path, _ = files
    gguf_file, backend = GGUFFile.open(path), TorchBackend(device="cpu")
    linear, embedding = (
        gguf_file.tensors["blk.0.ffn_up.weight"],
        gguf_file.tensors["token_embd.weight"],
    )
    assert linear.qtype == qtype
    weight = backend.load_tensor(gguf_file, linear, "linear")
    rows, cols = linear.shape
    assert type(weight) is Int8Weight and weight.nbytes == rows * cols + 2 * rows
    assert weight.nbytes == predicted_bytes("int8", linear)
    assert type(backend.load_tensor(gguf_file, embedding, "embedding")) is MappedRows
    logits = backend.load_tensor(gguf_file, embedding, "logits")
    assert type(logits) is RescoredLogits and logits.nbytes <= embedding.shape[0] * (embedding.shape[1] + 2)


def test_fp32_logits_equal_those_of_the_dequantized_reference(files, expected_logits):
    got, expected = corral.load_model(files[1], precision="fp32").logits(TOKENS), expected_logits
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0.1
    assert np.array_equal(got, expected)


def test_default_precision_logits_are_close_to_the_reference(files, expected_logits):
    got, expected = corral.load_model(files[1]).logits(TOKENS), expected_logits
    np.testing.assert_allclose(got, expected, rtol=0, atol=AUTO_TOLERANCE * np.abs(expected).max())


@pytest.mark.parametrize("qtype", [Q.MXFP4, Q.IQ4_XS], ids=lambda q: q.name)
def test_an_expert_stack_of_the_type_loads_as_int8_experts(tmp_path, qtype):
    # gpt-oss keeps its experts in MXFP4: one int8 linear per expert, over that expert's rows
    rng = np.random.default_rng(0)
    stack = rng.normal(0, 0.05, (4, 32, 256)).astype(np.float32)
    path = tmp_path / "experts.gguf"
    write_tensors(gguf.GGUFWriter(str(path), "llama"), {"ffn_up_exps.weight": (stack, qtype)}, rng)
    gguf_file = GGUFFile.open(path)
    info = gguf_file.tensors["ffn_up_exps.weight"]
    experts = TorchBackend(device="cpu").load_tensor(gguf_file, info, "experts")
    assert info.qtype == qtype and all(type(expert) is Int8Weight for expert in experts.experts)
    assert experts.nbytes == 4 * (32 * 256 + 2 * 32)
    reader = gguf.GGUFReader(str(path))
    exact = torch.from_numpy(gguf.quants.dequantize(reader.tensors[0].data, qtype).reshape(4, 32, 256).astype(np.float32))
    x, ids = torch.from_numpy(rng.normal(0, 1, (3, 256)).astype(np.float32)), torch.tensor([[0, 3], [3, 1], [2, 2]])
    expected = torch.einsum("ri,rkoi->rko", x, exact[ids])
    got = experts.matmul_selected(x, ids, None, None)
    torch.testing.assert_close(got, expected, rtol=0, atol=AUTO_TOLERANCE * float(expected.abs().max()))


UNREAD = [q for q in Q if q in gguf.GGML_QUANT_SIZES and gguf.GGML_QUANT_SIZES[q][0] > 1 and q not in DEQUANTIZERS]


@pytest.mark.parametrize("qtype", UNREAD, ids=lambda q: q.name)
def test_a_type_gguf_cannot_read_is_refused_by_name(tmp_path, qtype):
    path = write_tiny_llama(tmp_path / "tiny.gguf", tensor_types={"blk.0.attn_k.weight": qtype}, **SIZES)
    with pytest.raises(
        UnsupportedTensorTypeError,
        match=rf"'blk\.0\.attn_k\.weight' has type {qtype.name}",
    ):
        corral.load_model(path)
