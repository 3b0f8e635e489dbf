"""`create --quantize` and /api/create's `quantize`: the quantized GGUF becomes the model, which loads and
answers; bad types and quantized bases are refused with 400 and nothing written; the real smollm2
weights (dequantized to F32) quantize to the bytes ggml writes."""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib

import gguf
import httpx
import numpy as np
import ollama
import pytest
import trio
from click.testing import CliRunner
from gguf import GGMLQuantizationType as Q

from corral.cli import main
from corral.gguf import GGUFFile
from corral.modelfile import ModelSpec, create_model
from corral.quantize import QuantizeError, quantize_file
from corral.quantize.driver import as_float32, metadata_types
from corral.quantize.presets import preset
from corral.store import Store
from tiny_gguf import write_tiny_llama

pytestmark = pytest.mark.slow  # quantizes models, through the CLI and a server: out of the fast subset (-m "not slow")

# A tiny llama whose rows are whole K-quant super-blocks, every tensor F32 (the writer's default
# Q4_0 and Q8_0 linears turned back to F32).
F32_LLAMA = dict(
    block_count=4, embedding_length=256, feed_forward_length=512, head_count=4, head_count_kv=2,
    tensor_types={"blk.0.attn_q.weight": Q.F32, "blk.0.ffn_down.weight": Q.F32},
)


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("f32") / "tiny-f32.gguf", **F32_LLAMA)


@pytest.fixture
async def http(tiny_server):
    async with httpx.AsyncClient(base_url=tiny_server, timeout=120) as http:
        yield http


@pytest.fixture
def store(tiny_server, tmp_path) -> Store:
    return Store(tmp_path / "models")


async def in_thread(function, *args, **kwargs):
    return await trio.to_thread.run_sync(functools.partial(function, *args, **kwargs))


def model_types(store: Store, name: str) -> tuple[int, dict[str, Q]]:
    """The file type and tensor types of a stored model's GGUF."""
    return file_types(store.model_path(name))


def file_types(path) -> tuple[int, dict[str, Q]]:
    model = GGUFFile.open(path)
    try:
        return model.get("general.file_type"), {n: info.qtype for n, info in model.tensors.items()}
    finally:
        model.close()


def test_create_with_quantize_stores_the_quantized_gguf_and_reports_progress(tmp_path, f32_gguf):
    store = Store(tmp_path / "models")
    events = []
    create_model(store, "tiny-q4", ModelSpec(gguf_path=f32_gguf, quantize="q4_K_M"), progress=events.append)
    file_type, types = model_types(store, "tiny-q4")
    assert file_type == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert types["blk.0.attn_v.weight"] == Q.Q4_K and types["blk.3.attn_v.weight"] == Q.Q6_K  # use_more_bits(3, 4)
    assert types["token_embd.weight"] == Q.Q6_K and types["output_norm.weight"] == Q.F32
    quantizing = [e for e in events if e["status"] == "quantizing F32 model to Q4_K_M"]
    assert quantizing[-1]["completed"] == quantizing[-1]["total"] > 0
    assert [e["status"] for e in events][-2:] == ["writing manifest", "success"]
    kept = {path.name for path in store.blobs_dir.iterdir()}
    assert kept == {digest.replace(":", "-") for digest in store.manifest("tiny-q4").blobs}  # no F32 copy, no temp file


def test_quantized_blob_equals_quantize_file_of_the_source(tmp_path, f32_gguf):
    store = Store(tmp_path / "models")
    create_model(store, "tiny-q5", ModelSpec(gguf_path=f32_gguf, quantize="Q5_K_M"))
    quantize_file(f32_gguf, tmp_path / "direct.gguf", preset("q5_K_M"))
    assert store.model_path("tiny-q5").read_bytes() == (tmp_path / "direct.gguf").read_bytes()


def test_quantizing_a_quantized_model_is_refused_with_nothing_written(tmp_path):
    quantized = write_tiny_llama(tmp_path / "q.gguf")  # has Q4_0 and Q8_0 linears
    store = Store(tmp_path / "models")
    with pytest.raises(QuantizeError, match="only supported for F32, F16 and BF16 models; this one has Q4_0, Q8_0"):
        create_model(store, "x", ModelSpec(gguf_path=quantized, quantize="q4_K_M"))
    assert store.manifest("x") is None and not store.blobs_dir.exists()


def test_a_weight_that_is_not_finite_is_refused_and_leaves_no_file(tmp_path):
    broken = write_tiny_llama(tmp_path / "nan.gguf", **F32_LLAMA)
    model = GGUFFile.open(broken)
    offset = model.tensors["blk.2.ffn_up.weight"].offset
    model.close()
    with open(broken, "r+b") as file:
        file.seek(offset + 40)
        file.write(np.float32(np.nan).tobytes())
    with pytest.raises(QuantizeError, match="blk.2.ffn_up.weight has NaN or infinite values"):
        quantize_file(broken, tmp_path / "out.gguf", preset("q4_K_M"))
    assert not (tmp_path / "out.gguf").exists()


def test_requantizing_needs_to_be_asked_for(tmp_path, f32_gguf):
    q8 = tmp_path / "q8.gguf"
    quantize_file(f32_gguf, q8, preset("q8_0"))
    with pytest.raises(QuantizeError, match="requantizing from type Q8_0 is disabled"):
        quantize_file(q8, tmp_path / "q4.gguf", preset("q4_K_M"))
    quantize_file(q8, tmp_path / "q4.gguf", preset("q4_K_M"), allow_requantize=True)
    assert file_types(tmp_path / "q4.gguf")[1]["blk.1.attn_q.weight"] == Q.Q4_K


def write_gguf(path, tensors: dict) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow  # quantizes three sources
def test_f16_and_bf16_sources_quantize_like_their_float32_values(tmp_path, f32_gguf):
    """A half-precision file quantizes as the float32 file of the same values (read exactly)."""
    source = GGUFFile.open(f32_gguf)
    try:
        weights = {name: as_float32(source.raw(name), Q.F32).reshape(info.shape).copy() for name, info in source.tensors.items()}
    finally:
        source.close()
    for half in (Q.F16, Q.BF16):
        encoded = {name: gguf.quants.quantize(w, half) if w.ndim > 1 else w for name, w in weights.items()}
        write_gguf(tmp_path / "half.gguf", {name: (e, half if e.dtype == np.uint8 else Q.F32) for name, e in encoded.items()})
        exact = {name: as_float32(e.reshape(-1, e.shape[-1]), half).reshape(e.shape[:-1] + (-1,)) if e.dtype == np.uint8 else e for name, e in encoded.items()}
        write_gguf(tmp_path / "exact.gguf", {name: (v, Q.F32) for name, v in exact.items()})
        quantize_file(tmp_path / "half.gguf", tmp_path / "a.gguf", preset("q4_K_S"))
        quantize_file(tmp_path / "exact.gguf", tmp_path / "b.gguf", preset("q4_K_S"))
        assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes(), half.name


def test_metadata_keeps_its_types(tmp_path, f32_gguf):
    quantize_file(f32_gguf, tmp_path / "q.gguf", preset("q6_K"))
    before = gguf.GGUFReader(f32_gguf).fields
    after = gguf.GGUFReader(tmp_path / "q.gguf").fields
    changed = {"general.file_type", "general.quantization_version", "GGUF.tensor_count", "GGUF.kv_count"}
    for key, field in before.items():
        if key not in changed:
            assert after[key].types == field.types and after[key].contents() == field.contents(), key
    assert after["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q6_K
    assert after["general.quantization_version"].contents() == 2


# ---- over HTTP and the CLI ---------------------------------------------------------------------


async def upload(http, path) -> str:
    data = pathlib.Path(path).read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert (await http.post(f"/api/blobs/{digest}", content=data)).status_code in (200, 201)
    return digest


async def test_api_create_quantizes_an_uploaded_gguf_that_then_answers(tiny_server, store, f32_gguf):
    client = ollama.Client(host=tiny_server)
    digest = await in_thread(client.create_blob, f32_gguf)
    events = await in_thread(lambda: list(client.create("tiny-q8", files={"m.gguf": digest}, quantize="q8_0", stream=True)))
    statuses = [event.status for event in events]
    assert "quantizing F32 model to Q8_0" in statuses and statuses[-1] == "success"
    assert model_types(store, "tiny-q8")[0] == gguf.LlamaFileType.MOSTLY_Q8_0
    shown = await in_thread(client.show, "tiny-q8")
    assert shown.details.quantization_level == "Q8_0"
    reply = await in_thread(client.generate, "tiny-q8", "the", options={"num_predict": 3, "temperature": 0})
    assert reply.done and reply.eval_count > 0


async def test_api_create_quantizes_a_model_from_the_store_under_the_older_field_name(http, store, f32_gguf):
    digest = await upload(http, f32_gguf)
    assert (await http.post("/api/create", json={"model": "tiny-f32", "files": {"m.gguf": digest}, "stream": False})).status_code == 200
    reply = await http.post("/api/create", json={"model": "tiny-q4s", "from": "tiny-f32", "quantization": "Q4_K_S", "system": "hi"})
    assert reply.status_code == 200 and json.loads(reply.text.splitlines()[-1]) == {"status": "success"}
    _, types = model_types(store, "tiny-q4s")
    assert types["blk.0.attn_v.weight"] == Q.Q5_K and types["blk.0.ffn_down.weight"] == Q.Q4_K
    assert store.manifest("tiny-f32").model != store.manifest("tiny-q4s").model


async def test_api_create_streams_quantize_progress_while_it_quantizes(http, store, f32_gguf):
    digest = await upload(http, f32_gguf)
    body = {"model": "tiny-live", "files": {"m.gguf": digest}, "quantize": "q4_K_M"}
    seen = []
    async with http.stream("POST", "/api/create", json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            event = json.loads(line)
            seen.append(event)
            if event["status"].startswith("quantizing") and 0 < event["completed"] < event["total"]:
                assert store.manifest("tiny-live") is None  # the create waits on this reader: it is not done
    assert seen[-1] == {"status": "success"} and store.manifest("tiny-live") is not None


async def test_api_create_failing_while_quantizing_ends_the_stream_with_an_error(http, store, tmp_path):
    broken = write_tiny_llama(tmp_path / "nan.gguf", **F32_LLAMA)
    model = GGUFFile.open(broken)
    offset = model.tensors["blk.2.ffn_up.weight"].offset
    model.close()
    with open(broken, "r+b") as file:
        file.seek(offset)
        file.write(np.float32(np.inf).tobytes())
    digest = await upload(http, broken)
    reply = await http.post("/api/create", json={"model": "x", "files": {"m.gguf": digest}, "quantize": "q8_0"})
    last = json.loads(reply.text.splitlines()[-1])
    assert last == {"error": "tensor blk.2.ffn_up.weight has NaN or infinite values: the model is corrupt"}
    assert store.manifest("x") is None
    assert not [p for p in store.blobs_dir.iterdir() if p.name.startswith(".")]  # no temporary file left


@pytest.mark.parametrize(
    ("quantize", "says"),
    [
        ("q3_x", "unsupported quantization type 'q3_x': supported types are q4_0, q4_1, q5_0, q5_1, q8_0, q4_K_S, q4_K_M, q5_K_S, q5_K_M, q6_K"),
        ("q4_K_M", "quantization is only supported for F32, F16 and BF16 models; this one has Q4_0, Q8_0 tensors"),
    ],
)
async def test_api_create_refuses_bad_quantize_with_400_and_writes_nothing(http, store, quantize, says):
    blobs = sorted(p.name for p in store.blobs_dir.iterdir())
    reply = await http.post("/api/create", json={"model": "x", "from": "tiny-llama", "quantize": quantize})
    assert reply.status_code == 400
    assert reply.json()["error"] == says
    assert store.manifest("x") is None and sorted(p.name for p in store.blobs_dir.iterdir()) == blobs


async def test_cli_create_quantize_flag(tiny_server, store, f32_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("CORRAL_HOST", tiny_server.removeprefix("http://"))
    (tmp_path / "Modelfile").write_text(f"FROM {f32_gguf}\nSYSTEM Be brief.\n")
    call = functools.partial(
        CliRunner().invoke, main, ["create", "-q", "q4_K_M", "-f", str(tmp_path / "Modelfile"), "tiny-cli"], catch_exceptions=False
    )
    result = await trio.to_thread.run_sync(call)
    assert result.exit_code == 0, result.output
    assert model_types(store, "tiny-cli")[0] == gguf.LlamaFileType.MOSTLY_Q4_K_M


# ---- the real smollm2 weights ----------------------------------------------------------------


def tensors(path, names) -> dict[str, tuple[np.ndarray, Q]]:
    """Copies of some tensors' bytes [rows, row_bytes] and their types."""
    model = GGUFFile.open(path)
    try:
        return {name: (model.raw(name).copy(), model.tensors[name].qtype) for name in names}
    finally:
        model.close()


QUESTION = "What is the capital of France?"


def write_f32_copy(path, out) -> pathlib.Path:
    """The GGUF at `path` with every tensor dequantized to F32 by gguf, metadata as it was (a faster
    tiny_gguf.write_dequantized_copy: GGUFReader takes seconds over smollm2's vocabulary)."""
    source = GGUFFile.open(path)
    types = metadata_types(path)
    writer = gguf.GGUFWriter(out, source.architecture)
    for key, value in source.metadata.items():
        if key != "general.architecture":
            writer.add_key_value(key, value.tolist() if isinstance(value, np.ndarray) else value, *types[key])
    for name, info in source.tensors.items():  # astype copies: nothing keeps a view of the mapping
        writer.add_tensor(name, gguf.quants.dequantize(source.raw(name), info.qtype).reshape(info.shape).astype(np.float32))
    source.close()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return pathlib.Path(out)


def test_smollm2_dequantized_quantizes_to_ggml_bytes_with_q4_k_m_error(smollm2_path, tmp_path, llama_cpp_dir):
    """smollm2's weights as F32 -> Q4_K_M: tensors of each K type as ggml writes them, an error that is
    the quantization's, and models that load and answer."""
    import ggml_reference
    from corral.engine import load_model

    f32 = write_f32_copy(smollm2_path, tmp_path / "smollm2-f32.gguf")
    chosen = quantize_file(f32, tmp_path / "q4km.gguf", preset("q4_K_M"))
    assert {chosen.types[n] for n in chosen.types} >= {Q.Q4_K, Q.Q6_K, Q.F32}
    reference = ggml_reference.load(llama_cpp_dir)
    names = ("blk.0.attn_v.weight", "blk.1.attn_v.weight", "blk.0.ffn_gate.weight", "blk.29.ffn_down.weight")
    weights, quantized = tensors(f32, names), tensors(tmp_path / "q4km.gguf", names)
    for name in names:
        values = as_float32(weights[name][0], Q.F32)
        raw, qtype = quantized[name]
        np.testing.assert_array_equal(raw, reference.quantize(values, qtype.name))
        error = as_float32(raw, qtype).reshape(values.shape) - values
        assert 0 < np.sqrt(np.mean(error**2)) < 0.1 * np.sqrt(np.mean(values**2)), name
    # Q4_K_M costs smollm2 (135M) the right answer: llama-quantize's own Q4_K_M file answers as this one
    # does, in French (the F32 file and a Q8_0 say Paris).
    assert "".join(load_model(tmp_path / "q4km.gguf").generate(QUESTION, max_tokens=12)).strip()
