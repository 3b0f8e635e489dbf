"""`create` from a safetensors folder of a vision model: the tiny Gemma3ForConditionalGeneration of vision_driver.py
and LlavaForConditionalGeneration of llava_driver.py, converted by corral (the text model and, by
corral.convert.projector, its vision tower into a projector file) and by llama.cpp's converters (the drivers'
model.gguf, and mmproj.gguf: `convert_hf_to_gguf.py --mmproj` for Gemma 3, the LLaVA image-encoder converter for
LLaVA; marker `peers`).

The two projector files hold the same keys and values and the same tensors (names, shapes, types, values within
float16 rounding); the two text models are byte for byte equal; the created model answers an image with the logits
of the llama.cpp-converted pair (and so transformers'), and `corral show` lists its vision capability.
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
from corral.gguf import GGUFFile
from corral.modelfile import ModelSpec, create_model
from corral.modelfile.create import CreateModelError
from corral.store import MODEL_MEDIA_TYPE, PROJECTOR_MEDIA_TYPE, Store
from corral.vision import ImageRun

pytestmark = pytest.mark.peers  # every test here uses llama.cpp's sources: the fast subset does not even import this module

NAME = "made-vision:latest"
# The prompt index of the image's first row in the drivers' prompt_ids: BOS and 4 text tokens, then Gemma 3's <start_of_image>.
IMAGE_START = {"gemma3-vision": 6, "llava": 5}
# Keys that differ for a reason that is not the conversion: the LLaVA converter names the file after the folder it
# reads, the tower the driver cut out of the model ("tower"), where corral reads the whole model's folder ("hf").
UNLIKE_KEYS = {"gemma3-vision": set(), "llava": {"general.name"}}
F16_ROUNDING = 2.0**-11  # float16's relative rounding error


@pytest.fixture(scope="module", params=list(IMAGE_START))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def gemma3_vision(llama_cpp_dir):
    return cached(llama_cpp_dir)


@pytest.fixture(scope="module")
def reference(llama_cpp_dir, family):
    return cached(llama_cpp_dir, family)


@pytest.fixture(scope="module")
def created(reference, tmp_path_factory) -> Store:
    """A store with the model created from the driver's safetensors folder (`FROM ./hf`)."""
    store = Store(tmp_path_factory.mktemp("created") / "models")
    create_model(store, NAME, ModelSpec(hf_folder=reference.hf))
    return store


def values(path) -> dict[str, np.ndarray]:
    return {tensor.name: gguf.quants.dequantize(tensor.data, tensor.tensor_type) for tensor in gguf.GGUFReader(path).tensors}


def test_the_vision_tower_converts_as_llama_cpps_converter(reference, family, tmp_path):
    ours = convert_projector(reference.hf, tmp_path / "mmproj.gguf")
    (our_fields, our_tensors), (their_fields, their_tensors) = gguf_contents(ours), gguf_contents(reference.projector)
    assert {key for key in our_fields.keys() | their_fields.keys() if our_fields.get(key) != their_fields.get(key)} == UNLIKE_KEYS[family]
    assert {name: kind_shape[:2] for name, kind_shape in our_tensors.items()} == {name: kind_shape[:2] for name, kind_shape in their_tensors.items()}
    their_values = values(reference.projector)
    for name, value in values(ours).items():
        np.testing.assert_allclose(value, their_values[name], rtol=F16_ROUNDING, atol=0, err_msg=name)


def test_the_text_model_of_a_vision_folder_converts_as_llama_cpp_does(reference, tmp_path):
    assert_same_gguf(convert_folder(reference.hf, tmp_path / "model.gguf"), reference.model)


def test_a_folder_of_a_text_architecture_has_no_projector(gemma3_vision, tmp_path):
    folder = shutil.copytree(gemma3_vision.hf, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Gemma3ForCausalLM"]}))
    assert convert_projector(folder, tmp_path / "mmproj.gguf") is None and not (tmp_path / "mmproj.gguf").exists()


def test_create_stores_the_converted_tower_as_the_projector_layer(created, reference):
    manifest = created.manifest(NAME)
    assert [layer.media_type for layer in manifest.layers] == [MODEL_MEDIA_TYPE, PROJECTOR_MEDIA_TYPE]
    assert GGUFFile.open(created.projector_path(NAME)).tensors.keys() == GGUFFile.open(reference.projector).tensors.keys()


def test_quantize_is_for_the_text_model_the_projector_stays_as_converted(gemma3_vision, tmp_path):
    store = Store(tmp_path / "models")
    manifest = create_model(store, "made-q8", ModelSpec(hf_folder=gemma3_vision.hf, quantize="q8_0"))
    assert GGUFFile.open(store.model_path("made-q8")).metadata["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    converted = convert_projector(gemma3_vision.hf, tmp_path / "mmproj.gguf")
    assert store.blob_path(manifest.layer(PROJECTOR_MEDIA_TYPE).digest).read_bytes() == converted.read_bytes()


def test_the_created_model_answers_an_image_as_the_llama_cpp_converted_pair(created, reference, family):
    numbers = reference.reference()
    ids, data = [int(i) for i in numbers["ids"]], reference.image.read_bytes()
    logits = []
    for model_path, projector in ((created.model_path(NAME), created.projector_path(NAME)), (reference.model, reference.projector)):
        model = load_model(model_path, precision="fp32", projector=projector)
        logits.append(model.logits(ids, images=[ImageRun(IMAGE_START[family], model.vision.encode(data))]))
    ours, theirs = logits
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6 * np.abs(theirs).max())
    expected = numbers["logits"]  # and so transformers' (as test_vision_gemma3.py and test_vision_llava.py show for the pair)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-4 * np.abs(expected).max())


async def test_corral_show_lists_vision_for_the_created_model(created, tmp_path, nursery, monkeypatch):
    from conftest import _serve, copy_store

    url = await _serve(copy_store(created.root, tmp_path / "models"), nursery)
    monkeypatch.setenv("CORRAL_HOST", url.removeprefix("http://"))
    result = await trio.to_thread.run_sync(functools.partial(CliRunner().invoke, main, ["show", NAME], catch_exceptions=False))
    assert result.exit_code == 0, result.output
    capabilities = result.output.split("Capabilities", 1)[1].split("Parameters", 1)[0].split()
    assert capabilities == ["completion", "vision"]


def test_a_llava_read_past_its_class_row_is_refused(llama_cpp_dir, tmp_path):
    folder = shutil.copytree(cached(llama_cpp_dir, "llava").hf, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vision_feature_select_strategy": "full"}))
    with pytest.raises(CreateModelError, match="vision_feature_select_strategy 'full' does not convert"):
        create_model(Store(tmp_path / "models"), NAME, ModelSpec(hf_folder=folder))


def test_a_vision_folder_without_its_image_processor_is_refused_and_the_store_kept(gemma3_vision, tmp_path):
    folder = shutil.copytree(gemma3_vision.hf, tmp_path / "hf")
    (folder / "preprocessor_config.json").unlink()
    store = Store(tmp_path / "models")
    with pytest.raises(CreateModelError, match="no image processor image_mean"):
        create_model(store, NAME, ModelSpec(hf_folder=folder))
    assert not store.root.exists() or not any(store.root.rglob("sha256-*"))
