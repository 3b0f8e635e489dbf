"""Gemma 3 vision against transformers: a tiny random Gemma3ForConditionalGeneration (vision_driver.py),
converted by llama.cpp's converter into a text GGUF and an mmproj GGUF, run by corral.

Preprocessing must give the HF image processor's pixels exactly; the encoder (SigLIP + Gemma 3's
projector) its image features, and the text model with the image in its prompt its logits, both at
precision "fp32" within 1e-4 of their scale.
"""

from __future__ import annotations

import numpy as np
import pytest
from vision_references import cached

from corral.engine import load_model
from corral.gguf import GGUFFile
from corral.images import decode
from corral.vision import ImageRun

pytestmark = pytest.mark.peers  # every test here uses llama.cpp's sources: the fast subset does not even import this module

FP32_TOLERANCE = 1e-4
IMAGE_START = 6  # prompt index of the first image row in vision_driver.prompt_ids: BOS, 4 text, <start_of_image>


@pytest.fixture(scope="module")
def gemma3_vision(llama_cpp_dir):
    return cached(llama_cpp_dir)


@pytest.fixture(scope="module")
def fp32_model(gemma3_vision):
    return load_model(gemma3_vision.model, precision="fp32", projector=gemma3_vision.projector)


def test_the_converter_writes_a_gemma3_clip_projector(gemma3_vision):
    projector = GGUFFile.open(gemma3_vision.projector)
    assert (projector.architecture, projector.metadata["clip.projector_type"]) == ("clip", "gemma3")


def test_preprocessing_gives_the_hf_processors_pixels_exactly(gemma3_vision, fp32_model):
    pixels = fp32_model.vision.pixels(decode(gemma3_vision.image.read_bytes()))
    np.testing.assert_array_equal(pixels, gemma3_vision.reference()["pixel_values"])


def test_image_embeddings_match_transformers(gemma3_vision, fp32_model):
    expected = gemma3_vision.reference()["image_features"]
    got = fp32_model.backend.to_numpy(fp32_model.vision.encode(gemma3_vision.image.read_bytes()))
    assert got.shape == expected.shape == (fp32_model.vision.tokens_per_image, fp32_model.model.config.embedding_length)
    np.testing.assert_allclose(got, expected, rtol=0, atol=FP32_TOLERANCE * np.abs(expected).max())


def test_logits_with_an_image_match_transformers_at_every_position(gemma3_vision, fp32_model):
    reference = gemma3_vision.reference()
    ids, expected = [int(i) for i in reference["ids"]], reference["logits"]
    assert ids[IMAGE_START - 1] == gemma3_vision.ids()["boi_token_index"]
    image = ImageRun(IMAGE_START, fp32_model.vision.encode(gemma3_vision.image.read_bytes()))
    got = fp32_model.logits(ids, images=[image])
    np.testing.assert_allclose(got, expected, rtol=0, atol=FP32_TOLERANCE * np.abs(expected).max())


def test_an_images_rows_see_each_other_both_ways(gemma3_vision, fp32_model, monkeypatch):
    """Causal image rows give other logits at the image's rows: the bidirectional mask is what matches transformers."""
    reference = gemma3_vision.reference()
    ids, expected = [int(i) for i in reference["ids"]], reference["logits"]
    image = ImageRun(IMAGE_START, fp32_model.vision.encode(gemma3_vision.image.read_bytes()))
    monkeypatch.setattr(type(fp32_model.model), "bidirectional_images", False)
    causal = fp32_model.logits(ids, images=[image])
    first_image_row = causal[IMAGE_START]
    assert np.abs(first_image_row - expected[IMAGE_START]).max() > 100 * FP32_TOLERANCE * np.abs(expected).max()


def test_an_image_seen_again_is_not_encoded_again(gemma3_vision):
    model = load_model(gemma3_vision.model, precision="fp32", projector=gemma3_vision.projector)
    data = gemma3_vision.image.read_bytes()
    first = model.vision.encode(data)
    again = model.vision.encode(data)
    assert model.vision.encoded == 1 and again is first
