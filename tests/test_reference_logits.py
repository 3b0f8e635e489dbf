"""Corral's logits against transformers' on a tiny random model of every architecture (reference_models.py).

Each model is built with transformers' own classes, converted by llama.cpp's converter and loaded
with `corral.load_model`. Precision "fp32" must give transformers' float32 logits to 1e-4 of their
scale at every position; "auto" the same argmax wherever transformers' margin is clear. The same
files also run test_conformance.py's checks.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference_models import pytest_params

from corral.gguf import GGUFFile

pytestmark = pytest.mark.peers  # every test here uses llama.cpp's sources: the fast subset does not even import this module

FP32_TOLERANCE = 1e-4  # of the reference's largest |logit|
# test_conformance.py holds "auto" to 3e-2 of the scale against itself; if every logit may be off by
# that much, two logits further apart than twice it cannot swap, so the argmax must agree there.
CLEAR_MARGIN = 2 * 3e-2
# Out of 20 positions about half have a clear margin; fewer than 4 would leave too little to compare.
MIN_CLEAR_POSITIONS = 4


@pytest.mark.parametrize("spec", pytest_params(None))
def test_the_converter_writes_the_expected_architecture(spec, converted_references):
    gguf = GGUFFile.open(converted_references.gguf(spec))
    assert gguf.architecture == spec.architecture


@pytest.mark.parametrize("spec", pytest_params("fp32_logits"))
def test_fp32_logits_match_transformers_at_every_position(spec, converted_references, load_once):
    ids, expected = converted_references.logits(spec)
    got = load_once(converted_references.gguf(spec), "fp32").logits(ids)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=FP32_TOLERANCE * np.abs(expected).max())


@pytest.mark.parametrize("spec", pytest_params("auto_argmax"))
def test_auto_precision_keeps_the_argmax_where_the_reference_margin_is_clear(spec, converted_references, load_once):
    ids, expected = converted_references.logits(spec)
    got = load_once(converted_references.gguf(spec), "auto").logits(ids)
    top_two = np.sort(expected, axis=-1)[:, -2:]
    clear = top_two[:, 1] - top_two[:, 0] > CLEAR_MARGIN * np.abs(expected).max()
    assert clear.sum() >= MIN_CLEAR_POSITIONS
    np.testing.assert_array_equal(got.argmax(axis=-1)[clear], expected.argmax(axis=-1)[clear])
