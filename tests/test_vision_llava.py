"""LLaVA against transformers: a tiny random LlavaForConditionalGeneration (CLIP ViT, MLP projector, llama
text model; llava_driver.py), its text model converted by llama.cpp's convert_hf_to_gguf.py and its
image encoder by llama.cpp's LLaVA image-encoder converter (`clip.projector_type` "mlp"), run by corral.

Preprocessing (CLIP's shorter-side resize and centre crop, bicubic) must give the HF image processor's
pixels exactly; the encoder its image features and the text model with the image its logits, both at
precision "fp32" within 1e-4 of their scale; at the default precision the argmax where it is clear.
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
IMAGE_START = 5  # prompt index of the first image row in llava_driver.prompt_ids: BOS, 4 text


@pytest.fixture(scope="module")
def llava(llama_cpp_dir):
    return cached(llama_cpp_dir, "llava")


@pytest.fixture(scope="module")
def fp32_model(llava):
    return load_model(llava.model, precision="fp32", projector=llava.projector)


def test_the_converter_writes_an_mlp_clip_projector(llava):
    projector = GGUFFile.open(llava.projector)
    assert (projector.architecture, projector.metadata["clip.projector_type"]) == ("clip", "mlp")


def test_preprocessing_gives_the_hf_processors_pixels_exactly(llava, fp32_model):
    pixels = fp32_model.vision.pixels(decode(llava.image.read_bytes()))
    np.testing.assert_array_equal(pixels, llava.reference()["pixel_values"])


def test_image_embeddings_match_transformers(llava, fp32_model):
    expected = llava.reference()["image_features"]
    got = fp32_model.backend.to_numpy(fp32_model.vision.encode(llava.image.read_bytes()))
    assert got.shape == expected.shape == (fp32_model.vision.tokens_per_image, fp32_model.model.config.embedding_length)
    np.testing.assert_allclose(got, expected, rtol=0, atol=FP32_TOLERANCE * np.abs(expected).max())


def test_logits_with_an_image_match_transformers_at_every_position(llava, fp32_model):
    reference = llava.reference()
    ids, expected = [int(i) for i in reference["ids"]], reference["logits"]
    assert ids[IMAGE_START] == llava.ids()["image_token_index"] != ids[IMAGE_START - 1]
    image = ImageRun(IMAGE_START, fp32_model.vision.encode(llava.image.read_bytes()))
    got = fp32_model.logits(ids, images=[image])
    np.testing.assert_allclose(got, expected, rtol=0, atol=FP32_TOLERANCE * np.abs(expected).max())


def test_default_precision_picks_transformers_argmax_where_it_is_clear(llava):
    model = load_model(llava.model, projector=llava.projector)
    reference = llava.reference()
    ids, expected = [int(i) for i in reference["ids"]], reference["logits"]
    got = model.logits(ids, images=[ImageRun(IMAGE_START, model.vision.encode(llava.image.read_bytes()))])
    top2 = np.sort(expected, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.05 * np.abs(expected).max()
    assert clear.sum() >= len(ids) // 4
    np.testing.assert_array_equal(got[clear].argmax(1), expected[clear].argmax(1))


@pytest.mark.parametrize("precision", ["fp32", "auto"])
def test_the_projector_in_one_product_gives_the_embeddings_of_the_lone_row_path(llava, precision, monkeypatch):
    """The encoder pass runs the projector over the 64 rows left after the class row in one product each; the
    path it took before (those rows as lone decode rows, in chunks) gives the same embeddings within float error."""
    from corral.plugins.backends.torch import graph

    model = load_model(llava.model, precision=precision, projector=llava.projector)
    pixels = model.vision.pixels(decode(llava.image.read_bytes()))
    now = model.backend.to_numpy(model.vision.encode_pixels(pixels))
    monkeypatch.setattr(graph, "row_runs", lambda sequences, view: graph.sequence_runs(sequences))
    before = model.backend.to_numpy(model.vision.encode_pixels(pixels))
    np.testing.assert_allclose(now, before, rtol=0, atol=1e-6 * np.abs(before).max())
