"""What the mixture-of-experts architectures (Mixtral's llama files, qwen3moe, gpt-oss, deepseek2)
promise beyond the conformance suite: a sequence's logits have the same bits alone and batched,
DeepSeek's latent attention caches the latent and equals its decompressed form, gpt-oss's even
layers see only their window and its MXFP4 experts give their dequantized weights' logits."""

from __future__ import annotations

import numpy as np
import pytest
from test_conformance import TOKENS, load_tiny
from tiny_gguf import Q, write_dequantized_copy, write_tiny_deepseek2, write_tiny_gpt_oss, write_tiny_mixtral, write_tiny_qwen3moe

from corral.kvcache import CausalCache
from corral.model import Batch, CacheLayer

MOE = [
    pytest.param(("llama", __import__("tiny_gguf").write_tiny_llama), id="llama-dense"),
    pytest.param(("llama", write_tiny_mixtral), id="mixtral"),
    pytest.param(("qwen3moe", write_tiny_qwen3moe), id="qwen3moe"),
    pytest.param(("gpt-oss", write_tiny_gpt_oss), id="gpt-oss"),
    pytest.param(("deepseek2", write_tiny_deepseek2), id="deepseek2"),
]


def step(parts: list[tuple[int, int, list[int]]]) -> Batch:
    """One batch of (sequence, first position, tokens) parts, each part's rows together as the
    batching actor lays them out; the logits of each part's last row."""
    rows = [(token, start + i, seq) for seq, start, tokens in parts for i, token in enumerate(tokens)]
    tokens, positions, sequences = (np.array(column, dtype=np.int64) for column in zip(*rows))
    return Batch(tokens, positions, sequences, np.cumsum([len(tokens) for _, _, tokens in parts]) - 1)


# torch's elementwise kernels split work by thread and leave tails to scalar code (elementwise.py):
# the bits must hold at any thread count, not only the machine's (CI's and this machine's: 2).
@pytest.mark.parametrize("torch_threads", [1, 3], indirect=True, ids=lambda n: f"threads{n}")
@pytest.mark.parametrize("precision", ["auto", "fp32"])
@pytest.mark.parametrize("architecture", MOE)
def test_a_sequence_has_the_same_logits_alone_and_batched(tmp_path, architecture, precision, torch_threads):
    name, write = architecture
    tiny = load_tiny(write(tmp_path / "tiny.gguf"), name, precision)

    assert_alone_equals_batched(tiny)


def assert_alone_equals_batched(tiny, cache_type: str = "f16") -> None:
    """Three sequences' prompt logits, then their next token's, each run alone and then all in one batch
    (the decode rows in another order): the same bits. The cache has a region per sequence, as the runtime's."""

    def run(batch, cache):  # as the runtime runs a step: the backend knows the batch
        return tiny.backend.to_numpy(tiny.backend.run(tiny.model, batch, cache.prepare(batch)))

    def new_cache():
        return CausalCache(tiny.backend, tiny.model.cache_layers(), 128, num_seqs=4, cache_type=cache_type)

    prompts = {3: TOKENS[:7], 8: TOKENS[3:8], 6: TOKENS[1:8]}
    following = {3: TOKENS[9], 8: TOKENS[10], 6: TOKENS[11]}
    cache, alone = new_cache(), {}
    for seq, prompt in prompts.items():
        alone[seq, "prompt"] = run(step([(seq, 0, prompt)]), cache)[0]
    for seq, prompt in prompts.items():
        alone[seq, "decode"] = run(step([(seq, len(prompt), [following[seq]])]), cache)[0]

    cache = new_cache()
    together = run(step([(seq, 0, prompt) for seq, prompt in prompts.items()]), cache)
    for row, seq in enumerate(prompts):
        assert np.array_equal(together[row], alone[seq, "prompt"]), seq
    order = [8, 3, 6]  # the experts' rows gather in another order than the prompts'
    together = run(step([(seq, len(prompts[seq]), [following[seq]]) for seq in order]), cache)
    for row, seq in enumerate(order):
        assert np.array_equal(together[row], alone[seq, "decode"]), seq


def test_deepseek2_caches_one_latent_key_and_value_per_token(tmp_path):
    tiny = load_tiny(write_tiny_deepseek2(tmp_path / "mla.gguf"), "deepseek2", "fp32")
    # [rope 16 | latent 32] and the latent: not 4 heads of (32 + 16) decompressed.
    assert tiny.model.cache_layers() == [CacheLayer(1, 48, 32)] * 3


def test_deepseek2_latent_attention_equals_the_decompressed_heads(tmp_path):
    split = load_tiny(write_tiny_deepseek2(tmp_path / "split.gguf", tensor_types={"blk.0.attn_v_b.weight": Q.F32}), "deepseek2", "fp32")
    fused = load_tiny(write_tiny_deepseek2(tmp_path / "fused.gguf", fused_kv_b=True), "deepseek2", "fp32")
    assert fused.model.cache_layers()[0] == CacheLayer(4, 32, 16)
    batch = Batch.single(TOKENS, all_logits=True)
    expected = fused.run(batch)
    split.assert_close(split.run(batch), expected)


@pytest.mark.parametrize("precision", ["auto", "fp32"])
def test_gpt_oss_even_layers_hide_keys_older_than_the_window(tmp_path, precision):
    window = 4
    sliding = load_tiny(write_tiny_gpt_oss(tmp_path / "w4.gguf", sliding_window=window), "gpt-oss", precision)
    unbounded = load_tiny(write_tiny_gpt_oss(tmp_path / "w1k.gguf", sliding_window=1024), "gpt-oss", precision)
    assert [layer.window for layer in sliding.model.cache_layers()] == [window, None]
    batch = Batch.single(TOKENS, all_logits=True)
    windowed, full = sliding.run(batch), unbounded.run(batch)
    sliding.assert_close(windowed[:window], full[:window])
    assert np.abs(windowed[window:] - full[window:]).max(axis=-1).min() > 0.01 * np.abs(full).max()


@pytest.mark.parametrize("precision", ["auto", "fp32"])
def test_gpt_oss_with_mxfp4_experts_gives_the_logits_of_its_dequantized_weights(tmp_path, precision):
    # gpt-oss's files keep every expert stack in MXFP4
    experts = {f"blk.{i}.ffn_{p}_exps.weight": Q.MXFP4 for i in range(2) for p in ("gate", "up", "down")}
    path = write_tiny_gpt_oss(tmp_path / "mxfp4.gguf", tensor_types=experts)
    reference = load_tiny(write_dequantized_copy(path, tmp_path / "f32.gguf"), "gpt-oss", "fp32")
    tiny = load_tiny(path, "gpt-oss", precision)
    batch = Batch.single(TOKENS, all_logits=True)
    expected = reference.run(batch)
    if precision == "fp32":
        assert np.array_equal(tiny.run(batch), expected)
    else:  # int8 experts under bf16 activations: test_quant_types.py's bound for MXFP4 linears
        np.testing.assert_allclose(tiny.run(batch), expected, rtol=0, atol=5e-2 * np.abs(expected).max())
