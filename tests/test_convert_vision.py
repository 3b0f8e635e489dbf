"""`create` from a safetensors folder of a vision model: the tiny Gemma3ForConditionalGeneration of vision_driver.py,
converted by corral (the text model and, by corral.convert.projector, its vision tower into a projector file) and by
llama.cpp's converter (the driver's model.gguf, and mmproj.gguf from `--mmproj`; marker `peers`).

The two projector files hold the same keys and values and the same tensors (names, shapes, types, values within
float16 rounding); the two text models are byte for byte equal; the created model answers an image with the logits
of the llama.cpp-converted pair, and `corral show` lists its vision capability.
"""

from __future__ import annotations

import functools
import json
import shutil

import gguf
import numpy as np
import pytest
import trio
from click.testing import CliRunner
from test_convert import assert_same_gguf, gguf_contents
from vision_references import cached

from corral.cli import main
from corral.convert import convert_folder, convert_projector
from corral.engine import load_model
from corral.modelfile import ModelSpec, create_model
from corral.modelfile.create import CreateModelError
from corral.store import MODEL_MEDIA_TYPE, PROJECTOR_MEDIA_TYPE, Store
from corral.vision import ImageRun

NAME = "made-vision:latest"
IMAGE_START = 6  # the prompt index of the image's first row in vision_driver.prompt_ids
F16_ROUNDING = 2.0**-11  # float16's relative rounding error


@pytest.fixture(scope="module")
def gemma3_vision(llama_cpp_dir):
    return cached(llama_cpp_dir)


@pytest.fixture(scope="module")
def created(gemma3_vision, tmp_path_factory) -> Store:
    """A store with the model created from the driver's safetensors folder (`FROM ./hf`)."""
    store = Store(tmp_path_factory.mktemp("created") / "models")
    create_model(store, NAME, ModelSpec(hf_folder=gemma3_vision.hf))
    return store


def values(path) -> dict[str, np.ndarray]:
    return {tensor.name: gguf.quants.dequantize(tensor.data, tensor.tensor_type) for tensor in gguf.GGUFReader(path).tensors}


def test_the_vision_tower_converts_as_llama_cpps_mmproj(gemma3_vision, tmp_path):
    ours = convert_projector(gemma3_vision.hf, tmp_path / "mmproj.gguf")
    (our_fields, our_tensors), (their_fields, their_tensors) = gguf_contents(ours), gguf_contents(gemma3_vision.projector)
    assert our_fields == their_fields
    assert {name: kind_shape[:2] for name, kind_shape in our_tensors.items()} == {name: kind_shape[:2] for name, kind_shape in their_tensors.items()}
    their_values = values(gemma3_vision.projector)
    for name, value in values(ours).items():
        np.testing.assert_allclose(value, their_values[name], rtol=F16_ROUNDING, atol=0, err_msg=name)


def test_the_text_model_of_a_vision_folder_converts_as_llama_cpp_does(gemma3_vision, tmp_path):
    assert_same_gguf(convert_folder(gemma3_vision.hf, tmp_path / "model.gguf"), gemma3_vision.model)


def test_a_folder_of_a_text_architecture_has_no_projector(gemma3_vision, tmp_path):
    folder = shutil.copytree(gemma3_vision.hf, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Gemma3ForCausalLM"]}))
    assert convert_projector(folder, tmp_path / "mmproj.gguf") is None and not (tmp_path / "mmproj.gguf").exists()


def test_create_stores_the_converted_tower_as_the_projector_layer(created, gemma3_vision):
    manifest = created.manifest(NAME)
    assert [layer.media_type for layer in manifest.layers] == [MODEL_MEDIA_TYPE, PROJECTOR_MEDIA_TYPE]
    assert created.projector_path(NAME).stat().st_size == gemma3_vision.projector.stat().st_size


def test_the_created_model_answers_an_image_as_the_llama_cpp_converted_pair(created, gemma3_vision):
    reference = gemma3_vision.reference()
    ids, data = [int(i) for i in reference["ids"]], gemma3_vision.image.read_bytes()
    logits = []
    for model_path, projector in ((created.model_path(NAME), created.projector_path(NAME)), (gemma3_vision.model, gemma3_vision.projector)):
        model = load_model(model_path, precision="fp32", projector=projector)
        logits.append(model.logits(ids, images=[ImageRun(IMAGE_START, model.vision.encode(data))]))
    ours, theirs = logits
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6 * np.abs(theirs).max())
    expected = reference["logits"]  # and so transformers' (as test_vision_gemma3.py shows for the pair)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-4 * np.abs(expected).max())


async def test_corral_show_lists_vision_for_the_created_model(created, tmp_path, nursery, monkeypatch):
    from conftest import _serve, copy_store

    url = await _serve(copy_store(created.root, tmp_path / "models"), nursery)
    monkeypatch.setenv("CORRAL_HOST", url.removeprefix("http://"))
    result = await trio.to_thread.run_sync(functools.partial(CliRunner().invoke, main, ["show", NAME], catch_exceptions=False))
    assert result.exit_code == 0, result.output
    capabilities = result.output.split("Capabilities", 1)[1].split("Parameters", 1)[0].split()
    assert capabilities == ["completion", "vision"]


def test_a_vision_folder_without_its_image_processor_is_refused_and_the_store_kept(gemma3_vision, tmp_path):
    folder = shutil.copytree(gemma3_vision.hf, tmp_path / "hf")
    (folder / "preprocessor_config.json").unlink()
    store = Store(tmp_path / "models")
    with pytest.raises(CreateModelError, match="no image processor image_mean"):
        create_model(store, NAME, ModelSpec(hf_folder=folder))
    assert not store.root.exists() or not any(store.root.rglob("sha256-*"))
