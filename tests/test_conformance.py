"""The conformance suite every architecture plugin passes, on tiny random models of each architecture.

A plugin is loaded through the registry exactly as `load_model` does it, then checked for what the
runtime relies on: finite logits of the right shape, a KV cache that changes nothing, sequences
batched together that do not see each other, causal attention and the context shift. "fp32" must
agree to 1e-4 relative; "auto" (bf16 activations, int4 kernels) to a few bf16 roundings.

The models come from two sources: hand-written GGUFs (tiny_gguf.py, offline, with quantized
linears) and transformers models converted by llama.cpp's converter (reference_models.py, marked
`peers`), whose logits test_reference_logits.py also compares with transformers'.
"""

from __future__ import annotations

import importlib.util

import attrs
import numpy as np
import pytest
from reference_models import ReferenceSpec, pytest_params
from tiny_gguf import (
    VOCAB_SIZE,
    write_tiny_deepseek2,
    write_tiny_gemma3,
    write_tiny_gpt2,
    write_tiny_gpt_oss,
    write_tiny_llama,
    write_tiny_mixtral,
    write_tiny_qwen3moe,
)

import corral
from corral.gguf import GGUFFile
from corral.kvcache import CausalCache, shift_sequence
from corral.model import Batch
from corral.registry import Plugins

GPT2_MISSING = importlib.util.find_spec("corral_gpt2") is None

HAND_WRITTEN = [
    pytest.param(("llama", write_tiny_llama), id="llama"),
    pytest.param(("gemma3", write_tiny_gemma3), id="gemma3"),
    pytest.param(("llama", write_tiny_mixtral), id="mixtral"),
    pytest.param(("qwen3moe", write_tiny_qwen3moe), id="qwen3moe"),
    pytest.param(("gpt-oss", write_tiny_gpt_oss), id="gpt-oss"),
    pytest.param(("deepseek2", write_tiny_deepseek2), id="deepseek2"),
    pytest.param(
        ("gpt2", write_tiny_gpt2),
        id="gpt2",
        marks=pytest.mark.skipif(GPT2_MISSING, reason="example plugin missing: pip install -e examples/corral-gpt2"),
    ),
]
# Tolerance relative to the largest logit of the expected result.
TOLERANCE = {"fp32": 1e-4, "auto": 3e-2}

# Twelve tokens: longer than gemma3's tiny sliding window of 4, shorter than every context. Every
# reference model's vocabulary is at least as large as the hand-written ones'.
TOKENS = [int(t) for t in np.random.default_rng(7).integers(0, VOCAB_SIZE, 12)]


def pytest_generate_tests(metafunc):
    """Every test of a tiny model runs over the hand-written files and over every reference spec (whose
    known failures are per reference_models check: "loads" for the first test, "runs" for the rest)."""
    if "tiny_file" in metafunc.fixturenames:
        check = "loads" if metafunc.function is test_architecture_loads_through_the_registry else "runs"
        metafunc.parametrize("tiny_file", HAND_WRITTEN + pytest_params(check), indirect=True, scope="module")


@attrs.frozen
class Tiny:
    """A tiny model bound to a backend, run one batch at a time like the batching actor does."""

    architecture: str
    precision: str
    path: str
    model: object
    backend: object
    vocab_size: int

    def new_cache(self, cells: int = 32) -> CausalCache:
        return CausalCache(self.backend, self.model.cache_layers(), cells)

    def run(self, batch: Batch, cache: CausalCache | None = None) -> np.ndarray:
        cache = cache or self.new_cache()
        ctx = self.backend.new_context()
        (logits,) = ctx.compute(self.model.forward(ctx, batch, cache.prepare(batch)))
        return self.backend.to_numpy(logits)

    def assert_close(self, actual: np.ndarray, expected: np.ndarray) -> None:
        atol = TOLERANCE[self.precision] * float(np.abs(expected).max())
        np.testing.assert_allclose(actual, expected, rtol=0, atol=atol)


def load_tiny(path: str, architecture: str, precision: str) -> Tiny:
    plugins = Plugins()
    gguf = GGUFFile.open(path)
    backend = plugins.backends()["torch"](precision=precision)
    model = plugins.architecture_for(gguf).from_gguf(gguf, backend)
    return Tiny(architecture, precision, str(path), model, backend, len(gguf.metadata["tokenizer.ggml.tokens"]))


@pytest.fixture(scope="module")
def tiny_file(request, tmp_path_factory) -> tuple[str, str]:
    """(architecture, path) of a hand-written file or of a converted reference model (`pytest_generate_tests`)."""
    if isinstance(request.param, ReferenceSpec):
        return request.param.architecture, str(request.getfixturevalue("converted_references").gguf(request.param))
    architecture, write = request.param
    return architecture, write(tmp_path_factory.mktemp(architecture) / "tiny.gguf")


@pytest.fixture(scope="module", params=["auto", "fp32"])
def tiny(request, tiny_file) -> Tiny:
    architecture, path = tiny_file
    return load_tiny(path, architecture, request.param)


def interleaved_batch(first: tuple[int, list[int]], second: tuple[int, list[int]], start: int = 0) -> Batch:
    """Both sequences' tokens in one batch, rows alternating while both have tokens; logits of each last row."""
    rows: list[tuple[int, int, int]] = []  # (token, position, sequence)
    for i in range(max(len(first[1]), len(second[1]))):
        for seq, tokens in (first, second):
            if i < len(tokens):
                rows.append((tokens[i], start + i, seq))
    tokens, positions, sequences = (np.array(column, dtype=np.int64) for column in zip(*rows))
    last = [max(r for r, (_, _, s) in enumerate(rows) if s == seq) for seq in (first[0], second[0])]
    return Batch(tokens, positions, sequences, np.array(last, dtype=np.int64))


def test_architecture_loads_through_the_registry(tiny):
    assert type(tiny.model) is Plugins().architectures()[tiny.architecture]
    assert len(tiny.model.cache_layers()) == tiny.model.config.block_count


def test_load_model_runs_text_end_to_end(tiny):
    loaded = corral.load_model(tiny.path, precision=tiny.precision)
    ids = loaded.tokenize("in the hat")
    logits = loaded.logits(ids)
    assert loaded.info.architecture == tiny.architecture
    assert logits.shape == (len(ids), tiny.vocab_size)
    assert np.isfinite(logits).all()


def test_forward_gives_finite_logits_per_token(tiny):
    logits = tiny.run(Batch.single(TOKENS, all_logits=True))
    assert logits.shape == (len(TOKENS), tiny.vocab_size)
    assert np.isfinite(logits).all()
    assert np.abs(np.diff(logits, axis=0)).max(axis=-1).min() > 0.01  # every position gives its own row


def test_forward_returns_only_the_output_rows(tiny):
    every = tiny.run(Batch.single(TOKENS, all_logits=True))
    last = tiny.run(Batch.single(TOKENS))
    assert last.shape == (1, tiny.vocab_size)
    tiny.assert_close(last[0], every[-1])


def test_decoding_with_the_cache_matches_one_full_forward(tiny):
    expected = tiny.run(Batch.single(TOKENS, all_logits=True))
    cache = tiny.new_cache()
    prefix = 3
    decoded = [tiny.run(Batch.single(TOKENS[:prefix]), cache)[0]]
    for i in range(prefix, len(TOKENS)):
        decoded.append(tiny.run(Batch.single([TOKENS[i]], start=i), cache)[0])
    tiny.assert_close(np.array(decoded), expected[prefix - 1 :])


def test_two_sequences_in_one_batch_match_two_single_runs(tiny):
    a, b = TOKENS[:7], TOKENS[5:9][::-1]
    next_a, next_b = TOKENS[9], TOKENS[10]
    expected = []
    for prompt, following in ((a, next_a), (b, next_b)):
        cache = tiny.new_cache()
        expected.append(tiny.run(Batch.single(prompt), cache)[0])
        expected.append(tiny.run(Batch.single([following], start=len(prompt)), cache)[0])

    cache = tiny.new_cache()
    prefill = tiny.run(interleaved_batch((3, a), (8, b)), cache)
    # Decode rows in the other order; each sequence continues at its own position.
    decode = Batch(np.array([next_b, next_a]), np.array([len(b), len(a)]), np.array([8, 3]), np.array([1, 0]))
    decoded = tiny.run(decode, cache)
    tiny.assert_close(prefill[0], expected[0])
    tiny.assert_close(prefill[1], expected[2])
    tiny.assert_close(decoded[0], expected[1])
    tiny.assert_close(decoded[1], expected[3])


def test_logits_of_a_prefix_do_not_depend_on_later_tokens(tiny):
    k = 5
    changed = TOKENS[:k] + [(t + 1) % VOCAB_SIZE for t in TOKENS[k:]]
    original = tiny.run(Batch.single(TOKENS, all_logits=True))
    altered = tiny.run(Batch.single(changed, all_logits=True))
    tiny.assert_close(altered[:k], original[:k])
    assert np.abs(altered[k:] - original[k:]).max() > 10 * TOLERANCE[tiny.precision] * np.abs(original).max()


def test_context_shift_equals_translating_the_kept_tokens(tiny):
    """After a shift, the next logits equal those of the unshifted cache with the kept head moved right.

    Attention under RoPE depends only on distances, so dropping [keep, keep + discard) and moving the
    tail left by `discard` (the shift) must equal keeping the tail's cells as they were and computing
    the head again `discard` positions later, with the queries at their unshifted positions.
    (test_runtime.py checks the same on the real models.)
    """
    n, keep, discard = 10, 2, 4
    following = TOKENS[n:]

    def filled() -> CausalCache:
        cache = tiny.new_cache()
        tiny.run(Batch.single(TOKENS[:n]), cache)
        return cache

    shifted = filled()
    shifted.remove(0, keep, keep + discard)
    try:
        shift_sequence(tiny.model, shifted, 0, keep + discard, -discard)
    except NotImplementedError:
        pytest.skip(f"{tiny.architecture} cannot shift its cache (no RoPE to re-rotate)")
    got = tiny.run(Batch.single(following, start=n - discard, all_logits=True), shifted)

    translated = filled()
    translated.remove(0, 0, keep + discard)
    tiny.run(Batch.single(TOKENS[:keep], start=discard), translated)
    expected = tiny.run(Batch.single(following, start=n, all_logits=True), translated)

    unrotated = filled()  # positions moved but keys not re-rotated: what the check must tell apart
    unrotated.remove(0, keep, keep + discard)
    unrotated.shift_positions(0, keep + discard, -discard)
    wrong = tiny.run(Batch.single(following, start=n - discard, all_logits=True), unrotated)

    tiny.assert_close(got, expected)
    # A tiny model moves little for a 4-position mistake (llama: 5% of the scale), less than "auto"'s
    # tolerance allows: the shifted keys must be ten times closer than the unrotated ones.
    missed = np.abs(wrong - expected).max()
    assert missed > 1e-2 * np.abs(expected).max()
    assert missed > 10 * np.abs(got - expected).max()


@pytest.mark.parametrize("precision", ["auto", "fp32"])
def test_gemma3_sliding_window_hides_keys_older_than_the_window(tmp_path, precision):
    window = 4
    # Same seed, same weights: the files differ only in the window.
    sliding = load_tiny(write_tiny_gemma3(tmp_path / "w4.gguf", sliding_window=window), "gemma3", precision)
    unbounded = load_tiny(write_tiny_gemma3(tmp_path / "w1k.gguf", sliding_window=1024), "gemma3", precision)
    batch = Batch.single(TOKENS, all_logits=True)
    windowed, full = sliding.run(batch), unbounded.run(batch)
    sliding.assert_close(windowed[:window], full[:window])
    assert np.abs(windowed[window:] - full[window:]).max(axis=-1).min() > 0.05 * np.abs(full).max()
