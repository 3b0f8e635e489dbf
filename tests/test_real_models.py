"""The real models against the Hugging Face float32 reference (teacher forcing) and end to end."""

import numpy as np
import pytest

import corral
from conftest import reference_logits
from corral.plugins.backends.torch import native as torch_native

pytestmark = pytest.mark.real_model  # every test here uses a real model: the fast subset does not even import this module

MODELS = ("smollm2", "gemma3")
CLEAR_MARGIN = 1.0
FP32_TOLERANCE = 1e-3  # of the largest reference logit's magnitude


@pytest.fixture(scope="module")
def loaded(smollm2_path, gemma3_path, load_once):
    """`loaded(name, precision)`: a real model by short name, loaded once per session (see conftest.py)."""
    paths = {"smollm2": smollm2_path, "gemma3": gemma3_path}
    return lambda name, precision: load_once(paths[name], precision)


def teacher_forced(model, ref):
    """Logits of prompt + reference greedy ids in one forward; the rows that predict each step."""
    prompt = list(ref["input_ids"])
    logits = model.logits(prompt + list(ref["greedy_ids"]))
    steps = len(ref["step_top10_ids"])
    return logits, logits[len(prompt) - 1 : len(prompt) - 1 + steps]


@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("name", MODELS)
def test_default_precision_argmax_matches_reference_at_clear_margin_steps(loaded, name, index):
    ref = reference_logits(name, index)
    _, steps = teacher_forced(loaded(name, "auto"), ref)
    top = ref["step_top10_logits"]
    clear = top[:, 0] - top[:, 1] > CLEAR_MARGIN
    assert clear.sum() >= 5, "the reference should have clear-margin steps to check"
    got = steps.argmax(-1)
    expected = ref["step_top10_ids"][:, 0]
    mismatched = np.flatnonzero(clear & (got != expected))
    assert mismatched.size == 0, f"argmax differs at clear-margin steps {mismatched.tolist()}"


@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("name", MODELS)
def test_fp32_logits_match_reference_everywhere(loaded, name, index):
    ref = reference_logits(name, index)
    logits, steps = teacher_forced(loaded(name, "fp32"), ref)
    prompt_len = len(ref["input_ids"])
    tolerance = FP32_TOLERANCE * np.abs(ref["last_logits"]).max()
    np.testing.assert_allclose(logits[prompt_len - 1], ref["last_logits"], rtol=0, atol=tolerance)
    prompt_rows = np.take_along_axis(logits[:prompt_len], ref["prompt_top10_ids"], axis=1)
    np.testing.assert_allclose(prompt_rows, ref["prompt_top10_logits"], rtol=0, atol=tolerance)
    step_rows = np.take_along_axis(steps, ref["step_top10_ids"], axis=1)
    np.testing.assert_allclose(step_rows, ref["step_top10_logits"], rtol=0, atol=tolerance)


@pytest.fixture
def torch_kernels_only(monkeypatch):
    """The backend as on a machine without AVX-512 or AVX2, or without a C compiler: torch's kernels alone."""
    monkeypatch.setenv("CORRAL_NATIVE_KERNELS", "0")
    caches = (torch_native.load, torch_native.function)
    for cache in caches:
        cache.cache_clear()
    yield
    monkeypatch.undo()
    for cache in caches:
        cache.cache_clear()


@pytest.mark.parametrize("name", MODELS)
def test_torch_kernels_alone_match_the_reference_at_clear_margin_steps(torch_kernels_only, smollm2_path, gemma3_path, name):
    model = corral.load_model({"smollm2": smollm2_path, "gemma3": gemma3_path}[name])
    assert not torch_native.has("int4_blocks_matmul")
    ref = reference_logits(name, 0)
    _, steps = teacher_forced(model, ref)
    top = ref["step_top10_logits"]
    clear = top[:, 0] - top[:, 1] > CLEAR_MARGIN
    assert not np.flatnonzero(clear & (steps.argmax(-1) != ref["step_top10_ids"][:, 0])).size
    ids = list(ref["input_ids"]) + list(ref["greedy_ids"][:4])  # decode rows through torch's kernels too
    cache = model.new_cache(len(ids))
    model.forward(corral.model.Batch.single(ids[:-4]), cache)
    for offset in range(len(ids) - 4, len(ids)):
        last = model.forward(corral.model.Batch.single([ids[offset]], start=offset), cache)[-1]
    full = model.logits(ids)[-1]
    np.testing.assert_allclose(last, full, atol=0.05 * np.abs(full).max())


@pytest.mark.parametrize("name", MODELS)
def test_cached_decode_matches_one_forward(loaded, name):
    ref = reference_logits(name, 0)
    model = loaded(name, "auto")
    ids = list(ref["input_ids"]) + list(ref["greedy_ids"][:6])
    full = model.logits(ids)[-1]
    cache = model.new_cache(len(ids))
    model.forward(corral.model.Batch.single(ids[:-6]), cache)
    for offset in range(len(ids) - 6, len(ids)):
        last = model.forward(corral.model.Batch.single([ids[offset]], start=offset), cache)[-1]
    assert last.argmax() == full.argmax()
    np.testing.assert_allclose(last, full, atol=0.05 * np.abs(full).max())


def test_smollm2_answers_the_capital_of_france(loaded):
    answer = "".join(loaded("smollm2", "auto").generate("What is the capital of France?", max_tokens=24))
    assert "Paris" in answer


def test_gemma3_continues_code(loaded):
    # The packaged gemma3 270m is the base model: it completes text rather than chatting.
    text = "".join(loaded("gemma3", "auto").generate("def fibonacci(n):", max_tokens=16, raw=True))
    assert "return" in text


def test_generation_stops_at_max_tokens(loaded):
    model = loaded("smollm2", "auto")
    pieces = list(model.generate("The capital of France is", max_tokens=3, raw=True))
    assert len(model.tokenize("".join(pieces), add_special=False)) == 3


@pytest.mark.parametrize(
    ("name", "architecture", "quantization", "context_length"),
    [("smollm2", "llama", "Q4_1", 8192), ("gemma3", "gemma3", "Q4_K_M", 32768)],
)
def test_info_describes_the_model(loaded, name, architecture, quantization, context_length):
    info = loaded(name, "auto").info
    assert (info.architecture, info.quantization, info.context_length) == (architecture, quantization, context_length)
    assert 100e6 < info.parameter_count < 300e6
