"""Encoder and pooling pieces against direct computations: pooling rows, the torch backend's
bidirectional attention, a tiny nomic-bert file, and last-token pooling of a decoder (Qwen3-Embedding style)."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from corral.engine import load_model
from corral.plugins.backends.torch.bidirectional import bidirectional_attention
from corral.pooling import output_rows, pool
from corral.runner.runtime import Runtime


def test_output_rows_are_every_row_the_first_or_the_last_of_each_input():
    assert output_rows([3, 1, 2], "mean").tolist() == [0, 1, 2, 3, 4, 5]
    assert output_rows([3, 1, 2], "cls").tolist() == [0, 3, 4]
    assert output_rows([3, 1, 2], "last").tolist() == [2, 3, 5]
    with pytest.raises(ValueError, match="unknown pooling"):
        output_rows([1], "rank")


def test_mean_pooling_averages_each_input_own_rows():
    hidden = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    assert pool(hidden, [3, 1, 2], "mean").tolist() == [[2.0, 3.0], [6.0, 7.0], [9.0, 10.0]]
    assert pool(hidden[:4], [2, 2], "mean").tolist() == [[1.0, 2.0], [5.0, 6.0]]


@pytest.mark.parametrize("lengths", [[5], [4, 4, 4], [1, 7, 3]])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_bidirectional_attention_stays_within_each_input(lengths, kv_heads):
    generator = torch.Generator().manual_seed(0)
    n, heads, dim = sum(lengths), 4, 8
    q = torch.randn(n, heads, dim, generator=generator)
    k = torch.randn(n, kv_heads, dim, generator=generator)
    v = torch.randn(n, kv_heads, dim, generator=generator)
    out = bidirectional_attention(q, k, v, lengths, 0.3)
    expected, start = [], 0
    for length in lengths:
        rows = slice(start, start + length)
        keys = k[rows].repeat_interleave(heads // kv_heads, dim=1)
        values = v[rows].repeat_interleave(heads // kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("qhd,khd->hqk", q[rows], keys) * 0.3, dim=-1)
        expected.append(torch.einsum("hqk,khd->qhd", weights, values).reshape(length, -1))
        start += length
    assert torch.allclose(out, torch.cat(expected), atol=1e-5)


# --- a tiny nomic-bert ------------------------------------------------------------------------------

NOMIC = {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4, "context_length": 64}
NOMIC_EPS, NOMIC_ROPE_BASE, NOMIC_VOCAB = 1e-12, 1000.0, 300


def write_tiny_nomic_bert(path) -> dict[str, np.ndarray]:
    """A 2-block nomic-bert with mean pooling and random weights; returns the weights as written ([out, in])."""
    from tiny_gguf import EOT_ID, MERGES, VOCAB, VOCAB_TYPES

    rng = np.random.default_rng(0)
    d, ff = NOMIC["embedding_length"], NOMIC["feed_forward_length"]

    def rand(*shape, std=0.1):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    weights = {"token_embd.weight": rand(len(VOCAB), d, std=0.5), "token_types.weight": rand(2, d, std=0.5)}
    weights |= {"token_embd_norm.weight": 1 + rand(d), "token_embd_norm.bias": rand(d)}
    for i in range(NOMIC["block_count"]):
        p = f"blk.{i}."
        weights |= {p + "attn_qkv.weight": rand(3 * d, d, std=0.3), p + "attn_output.weight": rand(d, d)}
        weights |= {p + "attn_output_norm.weight": 1 + rand(d), p + "attn_output_norm.bias": rand(d)}
        weights |= {p + "ffn_gate.weight": rand(ff, d), p + "ffn_up.weight": rand(ff, d), p + "ffn_down.weight": rand(d, ff)}
        weights |= {p + "layer_output_norm.weight": 1 + rand(d), p + "layer_output_norm.bias": rand(d)}
    writer = gguf.GGUFWriter(str(path), "nomic-bert")
    for key, value in NOMIC.items():
        writer.add_uint32(f"nomic-bert.{key}", value)
    writer.add_float32("nomic-bert.attention.layer_norm_epsilon", NOMIC_EPS)
    writer.add_float32("nomic-bert.rope.freq_base", NOMIC_ROPE_BASE)
    writer.add_bool("nomic-bert.attention.causal", False)
    writer.add_uint32("nomic-bert.pooling_type", 1)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(VOCAB)
    writer.add_token_types(VOCAB_TYPES)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(EOT_ID)
    writer.add_eos_token_id(EOT_ID)
    for name, array in weights.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def nomic_bert_reference(w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """nomic-bert as its paper's diagram reads: embeddings + type 0, LayerNorm; per block
    LN(x + attention with NeoX RoPE), LN(x + SwiGLU); mean over the rows."""
    t = {name: torch.from_numpy(array).double() for name, array in w.items()}
    d, heads = NOMIC["embedding_length"], NOMIC["attention.head_count"]
    hd, n = d // heads, len(ids)

    def norm(x, name):
        return F.layer_norm(x, (d,), t[name + ".weight"], t[name + ".bias"], NOMIC_EPS)

    def rotate(x):  # [n, heads, hd], halves
        freqs = NOMIC_ROPE_BASE ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.arange(n, dtype=torch.float64)[:, None] * freqs[None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    x = norm(t["token_embd.weight"][ids] + t["token_types.weight"][0], "token_embd_norm")
    for i in range(NOMIC["block_count"]):
        p = f"blk.{i}."
        q, k, v = (x @ t[p + "attn_qkv.weight"].T).split(d, dim=-1)
        q, k, v = rotate(q.reshape(n, heads, hd)), rotate(k.reshape(n, heads, hd)), v.reshape(n, heads, hd)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, d)
        x = norm(x + attn @ t[p + "attn_output.weight"].T, p + "attn_output_norm")
        ffn = (F.silu(x @ t[p + "ffn_gate.weight"].T) * (x @ t[p + "ffn_up.weight"].T)) @ t[p + "ffn_down.weight"].T
        x = norm(x + ffn, p + "layer_output_norm")
    return x.mean(0).numpy()


async def test_nomic_bert_matches_a_direct_computation(tmp_path):
    weights = write_tiny_nomic_bert(tmp_path / "nomic.gguf")
    inputs = [[5, 17, 250, 3, 99, 12, 7], [42, 8], list(range(30, 60))]
    async with Runtime.open(tmp_path / "nomic.gguf", precision="fp32", num_parallel=1) as rt:
        out = await rt.embed(inputs, normalized=False)
    for ids, vector in zip(inputs, out.embeddings):
        assert np.allclose(vector, nomic_bert_reference(weights, ids), atol=1e-4)


# --- last-token pooling of a decoder -----------------------------------------------------------------


def with_pooling(path, out, arch: str, pooling_type: int):
    """A copy of a GGUF file with `<arch>.pooling_type` added."""
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(out), arch)
    copy_with_new_metadata(reader, writer, {f"{arch}.pooling_type": MetadataDetails(gguf.GGUFValueType.UINT32, pooling_type)}, [])
    return out


async def test_decoder_last_token_pooling_is_the_final_normed_state_of_the_causal_forward(tmp_path):
    from tiny_gguf import write_tiny_llama

    path = with_pooling(write_tiny_llama(tmp_path / "qwen3.gguf", architecture="qwen3"), tmp_path / "qwen3-embed.gguf", "qwen3", 3)
    inputs = [[5, 17, 250, 3, 99], [42, 8], list(range(30, 50))]
    model = load_model(path, precision="fp32")
    (embd,) = [t for t in gguf.GGUFReader(str(path)).tensors if t.name == "token_embd.weight"]
    embedding = torch.from_numpy(np.array(embd.data, dtype=np.float32))  # tied output: logits = normed state @ token_embd.T
    async with Runtime.open(model, num_parallel=1) as rt:
        out = await rt.embed(inputs, normalized=False)
        text = await rt.embed(["the cat"])
    for ids, vector in zip(inputs, out.embeddings):
        logits = model.logits(ids)[-1]  # the causal forward of this input alone
        assert np.allclose((torch.tensor(vector) @ embedding.T).numpy(), logits, atol=1e-4)
    assert len(text.embeddings[0]) == 64 and abs(np.linalg.norm(text.embeddings[0]) - 1) < 1e-5
