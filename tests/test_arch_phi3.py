"""Phi-3's LongRoPE: the short or long factors follow the context of the cache a forward runs over,
as llama.cpp picks them by num_ctx (the logits themselves are test_reference_logits.py's)."""

from __future__ import annotations

import numpy as np
import pytest
from reference_models import SPECS_BY_NAME

from corral.engine import load_model
from corral.model import Batch

pytestmark = pytest.mark.peers  # every test here uses llama.cpp's sources: the fast subset does not even import this module

LONGROPE = SPECS_BY_NAME["phi3-longrope"]  # trained on 64 positions


@pytest.mark.parametrize("spec", [LONGROPE], ids=[f"ref-{LONGROPE.name}"])
def test_longrope_factors_follow_the_cache_context_also_in_a_reused_graph(spec, converted_references, load_once):
    path = converted_references.gguf(spec)
    ids, expected = converted_references.logits(spec)
    scale = np.abs(expected).max()
    model = load_once(path, "fp32")
    original = model.model.config.rope_original_context
    batch = Batch.single(ids, all_logits=True)

    within = model.forward(batch, model.new_cache(original))  # short factors: transformers' logits
    beyond = model.forward(batch, model.new_cache(original + 1))  # the graph of `within`, run again
    again = model.forward(batch, model.new_cache(original))
    fresh = load_model(path, precision="fp32").forward(batch, model.new_cache(original + 1))

    np.testing.assert_allclose(within, expected, rtol=0, atol=1e-4 * scale)
    assert np.abs(beyond - within).max() > 0.05 * scale
    np.testing.assert_allclose(beyond, fresh, rtol=0, atol=1e-6 * scale)
    np.testing.assert_allclose(again, within, rtol=0, atol=1e-6 * scale)
