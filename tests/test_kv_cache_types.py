"""KV cache types (Ollama's OLLAMA_KV_CACHE_TYPE): f16, and ggml's q8_0 / q4_0 blocks quantized as rows are
written. Their bytes are ggml's (gguf.quants is the reference), q8_0 halves the cache and the estimate follows,
a sequence's logits keep their bits alone and batched, and an unknown type asked for is a clear error (400 over HTTP)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from test_arch_moe import assert_alone_equals_batched, step
from test_conformance import TOKENS, load_tiny
from tiny_gguf import write_tiny_gemma3, write_tiny_gpt_oss, write_tiny_llama, write_tiny_qwen3moe

from corral import memory
from corral.kvcache import CausalCache, shift_sequence
from corral.options import InvalidOptionError, parse_options
from corral.plugins.backends.torch.backend import TorchBackend
from corral.plugins.backends.torch.kv_cells import QuantizedCells, quantize_q4_0, quantize_q8_0
from corral.runner.runtime import Runtime
from corral.scheduler import kv_cache_type_from_env

QUANTIZED = {"q8_0": (quantize_q8_0, Q.Q8_0), "q4_0": (quantize_q4_0, Q.Q4_0)}
# Head dims of 32 (one block): the tiny files' defaults are 16.
ARCHITECTURES = [
    pytest.param(("llama", lambda path: write_tiny_llama(path, head_count=2, head_count_kv=1)), id="llama"),
    pytest.param(("gemma3", lambda path: write_tiny_gemma3(path, key_length=32, value_length=32)), id="gemma3-sliding"),
    pytest.param(("qwen3moe", write_tiny_qwen3moe), id="qwen3moe"),
    pytest.param(("gpt-oss", lambda path: write_tiny_gpt_oss(path, key_length=32, value_length=32)), id="gpt-oss-sinks"),
]


def rows_with_edge_cases() -> torch.Tensor:
    """Random rows of 4 blocks, with an all-zero block, ties at .5 and a block whose extreme is negative."""
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(0)) * 3
    x[0, :32] = 0
    x[1, :32] = torch.tensor([0.5, -1.5] * 16) * (127 / 1.5)  # scale 1/127 of 1.5 * 127 / 1.5: codes at exact halves
    x[2, 32:64] = -torch.arange(32.0)
    return x


@pytest.mark.parametrize("kind", QUANTIZED)
def test_quantized_rows_have_ggml_bytes(kind):
    quantize, qtype = QUANTIZED[kind]
    x = rows_with_edge_cases()
    codes, scales = quantize(x)
    blocks = np.concatenate([scales.view(torch.uint8).reshape(16, 4, 2).numpy(), codes.view(torch.uint8).reshape(16, 4, -1).numpy()], -1)
    assert np.array_equal(blocks.reshape(16, -1), quants.quantize(x.numpy(), qtype))


@pytest.mark.parametrize("kind", QUANTIZED)
def test_cells_read_back_as_ggml_dequantizes_them(kind):
    x = rows_with_edge_cases()
    cells = QuantizedCells(kind, (2, 16, 128), torch.float32, torch.device("cpu"))
    cells.write(torch.arange(4), x[:8].reshape(4, 2, 128))  # 4 rows of 2 heads into cells 0..3 (an index)
    cells.write(slice(8, 12), x[8:].reshape(4, 2, 128))  # and 8..11 (a slice)
    expected = quants.dequantize(quants.quantize(x.numpy(), QUANTIZED[kind][1]), QUANTIZED[kind][1]).reshape(8, 2, 128)
    read = cells.read(lambda t: t[:, [0, 1, 2, 3, 8, 9, 10, 11]]).transpose(0, 1).numpy()
    assert np.array_equal(read, expected)


def cache_bytes(cache: CausalCache) -> int:
    return sum(buffer.nbytes for buffer in cache.keys + cache.values)


def test_q8_0_halves_the_pool_and_the_estimate_follows(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf", head_count=2, head_count_kv=1)
    tiny = load_tiny(path, "llama", "auto")
    caches = {kind: CausalCache(tiny.backend, tiny.model.cache_layers(), 256, num_seqs=2, cache_type=kind) for kind in ("f16", "q8_0", "q4_0")}
    f16 = cache_bytes(caches["f16"])
    assert cache_bytes(caches["q8_0"]) == f16 * 34 // 64  # a block of 32 values: 32 codes and a 2-byte scale
    assert cache_bytes(caches["q4_0"]) == f16 * 18 // 64
    estimates = {kind: memory.estimate(path, 128, 2, kv_cache_type=kind) for kind in caches}
    for kind, cache in caches.items():
        assert estimates[kind].kv_cache == cache_bytes(cache)
        assert estimates[kind].total - estimates[kind].kv_cache == estimates["f16"].total - estimates["f16"].kv_cache


@pytest.mark.parametrize("precision", ["auto", "fp32"])
@pytest.mark.parametrize("kind", QUANTIZED)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_sequence_has_the_same_logits_alone_and_batched(tmp_path, architecture, kind, precision):
    name, write = architecture
    tiny = load_tiny(write(tmp_path / "tiny.gguf"), name, precision)

    assert_alone_equals_batched(tiny, kind)


@pytest.mark.parametrize(("kind", "tolerance"), [("q8_0", 0.02), ("q4_0", 0.25)])
def test_quantized_cache_logits_stay_near_the_f16_caches(tmp_path, kind, tolerance):
    tiny = load_tiny(write_tiny_llama(tmp_path / "tiny.gguf", head_count=2, head_count_kv=1), "llama", "fp32")

    def last_logits(cache_type):
        cache = CausalCache(tiny.backend, tiny.model.cache_layers(), 64, cache_type=cache_type)
        tiny.run(step([(0, 0, TOKENS[:8])]), cache)
        return tiny.run(step([(0, 8, [TOKENS[8]])]), cache)[0]

    reference, quantized = last_logits("f16"), last_logits(kind)
    assert not np.array_equal(quantized, reference)  # the cache really held fewer bits
    assert np.abs(quantized - reference).max() <= tolerance * np.abs(reference).max()


def test_a_context_shift_re_rotates_quantized_keys(tmp_path):
    """Shifting a sequence's keys in a q8_0 cache gives what the f16 cache gives after the same shift, to q8_0's error."""
    tiny = load_tiny(write_tiny_llama(tmp_path / "tiny.gguf", head_count=2, head_count_kv=1), "llama", "fp32")

    def after_shift(cache_type):
        cache = CausalCache(tiny.backend, tiny.model.cache_layers(), 64, cache_type=cache_type)
        tiny.run(step([(0, 0, TOKENS[:10])]), cache)
        cache.remove(0, 1, 4)
        shift_sequence(tiny.model, cache, 0, 4, -3)
        return tiny.run(step([(0, 7, [TOKENS[10]])]), cache)[0]

    reference, shifted = after_shift("f16"), after_shift("q8_0")
    assert np.abs(shifted - reference).max() <= 0.02 * np.abs(reference).max()


def test_a_head_dim_off_the_block_size_is_a_clear_error():
    with pytest.raises(InvalidOptionError, match="multiple of 32"):
        TorchBackend("cpu").kv_buffer((2, 8, 16), "q8_0")


def test_an_unknown_cache_type_is_refused_where_it_is_asked_for(monkeypatch):
    with pytest.raises(InvalidOptionError, match="kv_cache_type"):
        parse_options({"kv_cache_type": "q5_1"})
    assert parse_options({"kv_cache_type": "q4_0"}).kv_cache_type == "q4_0"
    with pytest.raises(InvalidOptionError, match="f16, q8_0, q4_0"):
        CausalCache(TorchBackend("cpu"), [], 8, cache_type="int8")
    monkeypatch.setenv("OLLAMA_KV_CACHE_TYPE", "q8_0")
    assert kv_cache_type_from_env() == "q8_0"
    monkeypatch.setenv("CORRAL_KV_CACHE_TYPE", "q4_0")  # CORRAL_ first, as every setting
    assert kv_cache_type_from_env() == "q4_0"  # an unknown name there is ignored, as Ollama does: tests/test_kv_cache_fallback.py


async def test_runtime_open_takes_a_cache_type(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf", head_count=2, head_count_kv=1)
    async with Runtime.open(path, num_parallel=1, num_ctx=64, kv_cache_type="q4_0") as rt:
        assert rt.cache.cache_type == "q4_0" and isinstance(rt.cache.keys[0], QuantizedCells)
        async with rt.generate("hello", {"temperature": 0, "num_predict": 4}, raw=True) as stream:
            text, final = await stream.collect()
        assert final.eval_count == 4
    with pytest.raises(InvalidOptionError):
        async with Runtime.open(path, num_parallel=1, num_ctx=64, kv_cache_type="q3_k"):
            pass


async def test_http_refuses_an_unknown_cache_type_with_a_400(tiny_server):
    async with httpx.AsyncClient(base_url=tiny_server) as client:
        response = await client.post(
            "/api/generate", json={"model": "tiny-llama", "prompt": "hi", "stream": False, "options": {"kv_cache_type": "q2"}}
        )
    assert response.status_code == 400
    assert "kv_cache_type" in response.json()["error"]


async def test_http_passes_the_option_to_the_runner_which_refuses_a_model_it_cannot_quantize(tiny_server):
    """The tiny store's llama has heads of 16 values, half a block: its runner says so, as a 400."""
    async with httpx.AsyncClient(base_url=tiny_server, timeout=120) as client:
        response = await client.post(
            "/api/generate",
            json={"model": "tiny-llama", "prompt": "hi", "stream": False, "options": {"kv_cache_type": "q8_0", "num_predict": 2}},
        )
    assert response.status_code == 400
    assert "multiple of 32" in response.json()["error"] and "use f16" in response.json()["error"]
