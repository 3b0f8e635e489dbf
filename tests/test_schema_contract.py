"""The schema is the contract (issue 16, section 1): what create accepts can load, options are checked
before a runner sees them, /openapi.json rejects exactly what the handlers reject, and error bodies name no
server path. Over HTTP against a live server on the tiny synthetic models (tests/tiny_gguf.py)."""

import hashlib
import json
import os
import pathlib
import sys

import gguf
import httpx
import jsonschema
import pytest
import trio
from conftest import TINY_LLAMA
from hypothesis import given, settings
from hypothesis import strategies as st
from gguf import GGMLQuantizationType as Q
from tiny_gguf import write_tiny_llama

from corral.options import STANDARD_OPTIONS, InvalidOptionError, options_schema, parse_options
from corral.server.http import public_message
from corral.errors import InvalidModelNameError
from corral.store import MODEL_MEDIA_TYPE, Store, name_pattern, parse_name


@pytest.fixture
async def client(tiny_server):
    async with httpx.AsyncClient(base_url=tiny_server, timeout=60) as client:
        yield client


@pytest.fixture
def store(tiny_server, tmp_path) -> Store:
    """The live server's store (tiny_server copies the tiny store under this test's tmp_path)."""
    return Store(tmp_path / "models")


async def upload(client: httpx.AsyncClient, path: str) -> str:
    data = pathlib.Path(path).read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert (await client.post(f"/api/blobs/{digest}", content=data)).status_code == 201
    return digest


def assert_no_server_path(text: str, *roots: pathlib.Path) -> None:
    for root in (*roots, pathlib.Path.home(), pathlib.Path(sys.prefix)):
        assert str(root) not in text
    assert "Traceback" not in text and 'File "' not in text


def with_metadata(source: str, out: pathlib.Path, **changes) -> str:
    """A copy of the float32 GGUF at `source` with some metadata values changed (same tensors)."""
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(os.fspath(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture",):
            continue
        value = changes.get(key, field.contents())
        item_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, value, field.types[0], sub_type=item_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data)  # float32 tensors only: their data has the shape already
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(out)


# --- create checks that a file binds ------------------------------------------------------------------------


async def test_create_refuses_a_gguf_whose_architecture_no_plugin_provides(client, tmp_path):
    digest = await upload(client, write_tiny_llama(tmp_path / "odd.gguf", architecture="nosucharch"))
    response = await client.post("/api/create", json={"model": "odd", "files": {"odd.gguf": digest}, "stream": False})
    assert response.status_code == 400
    assert "architecture 'nosucharch' is not supported" in response.json()["error"]
    assert (await client.post("/api/show", json={"model": "odd"})).status_code == 404  # nothing was created


async def test_create_refuses_a_gguf_missing_a_tensor_its_architecture_needs(client, tmp_path):
    digest = await upload(client, write_tiny_llama(tmp_path / "holed.gguf", drop=["blk.1.ffn_up.weight"]))
    response = await client.post("/api/create", json={"model": "holed", "files": {"m.gguf": digest}, "stream": False})
    assert response.status_code == 400
    assert "blk.1.ffn_up.weight" in response.json()["error"]


async def test_create_refuses_a_gguf_whose_embedding_width_contradicts_its_metadata(client, tmp_path):
    source = write_tiny_llama(tmp_path / "tiny.gguf", tensor_types={"blk.0.attn_q.weight": Q.F32, "blk.0.ffn_down.weight": Q.F32})
    digest = await upload(client, with_metadata(source, tmp_path / "wide.gguf", **{"llama.embedding_length": 96}))
    response = await client.post("/api/create", json={"model": "wide", "files": {"m.gguf": digest}, "stream": False})
    assert response.status_code == 400
    assert "embedding_length is 96" in response.json()["error"]


async def test_create_accepts_a_gguf_that_binds(client, tmp_path):
    digest = await upload(client, write_tiny_llama(tmp_path / "fine.gguf", seed=3))
    response = await client.post("/api/create", json={"model": "fine", "files": {"m.gguf": digest}, "stream": False})
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "success"}


async def test_a_stored_model_that_cannot_load_says_what_to_do_and_names_no_path(client, store, tmp_path):
    # As if pulled from a registry before create checked files: the store holds a GGUF no plugin runs.
    data = pathlib.Path(write_tiny_llama(tmp_path / "odd.gguf", architecture="nosucharch")).read_bytes()
    digest = store.write_blob(data, "sha256:" + hashlib.sha256(data).hexdigest())
    store.write_manifest("odd", [(MODEL_MEDIA_TYPE, digest)])
    for path, body in (("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}), ("/api/tokenize", {"content": "hi"}),
                       ("/v1/completions", {"prompt": "hi"})):  # fmt: skip
        response = await client.post(path, json={"model": "odd", "stream": False} | body)
        assert 400 <= response.status_code < 600
        assert "nosucharch" in response.text and "re-create the model" in response.text
        assert_no_server_path(response.text, tmp_path)


# --- options are checked before a runner sees them ------------------------------------------------------------


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
@pytest.mark.parametrize("prompt", [True, False], ids=["generating", "loading"])
async def test_negative_num_ctx_is_a_400_naming_it(client, path, prompt):
    body = {"model": TINY_LLAMA, "stream": False, "options": {"num_ctx": -5, "num_predict": 1}}
    if prompt:
        body |= {"prompt": "hi"} if path == "/api/generate" else {"messages": [{"role": "user", "content": "hi"}]}
    response = await client.post(path, json=body)
    assert response.status_code == 400
    assert "num_ctx" in response.json()["error"]
    assert (await client.get("/api/ps")).json()["models"] == []  # nothing was loaded


async def test_a_huge_num_batch_is_clamped_to_the_context(client):
    response = await client.post(
        "/api/generate", json={"model": TINY_LLAMA, "prompt": "hi", "stream": False, "options": {"num_batch": 10**12, "num_predict": 2}}
    )
    assert response.status_code == 200, response.text
    assert response.json()["eval_count"] == 2


# --- the schema rejects what the handlers reject ---------------------------------------------------------------

_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats(-1e6, 1e6, allow_nan=False) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
    max_leaves=4,
)
_EDGES = st.sampled_from([-2, -1, 0, 1, 2, 0.5, 1.5, 100, -100, 100.5, 40.0, True, "1", [], ["a"], {}])


@settings(max_examples=120, deadline=None)
@given(name=st.sampled_from(sorted(STANDARD_OPTIONS)), value=_EDGES | _JSON_VALUES)
def test_the_options_schema_accepts_exactly_what_parsing_accepts(name, value):
    if value is None:
        return  # null means "the default" to both
    schema = options_schema()["properties"][name]
    try:
        parse_options({name: value})
        parsed = True
    except InvalidOptionError as error:
        parsed = False
        assert repr(name) in str(error)
    assert jsonschema.Draft202012Validator(schema).is_valid(value) == parsed, (name, value, schema)


_NAME_TEXT = st.text(st.sampled_from("aZ09_.-:/ é"), max_size=12) | st.from_regex(name_pattern(), fullmatch=True)


@settings(max_examples=150, deadline=None)
@given(name=_NAME_TEXT)
def test_the_model_name_schema_accepts_exactly_what_the_store_accepts(name):
    try:
        parse_name(name)
        accepted = True
    except InvalidModelNameError:
        accepted = False
    assert jsonschema.Draft202012Validator({"type": "string", "pattern": name_pattern()}).is_valid(name) == accepted, name


async def test_openapi_gives_each_option_its_type_and_range(client):
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    options = schemas["Options"]["properties"]
    assert options["num_ctx"] == {"type": "integer", "minimum": 1}
    assert options["top_p"] == {"type": "number", "minimum": 0.0, "maximum": 1.0}
    assert options["repeat_penalty"]["exclusiveMinimum"] == 0.0
    assert options["xtc_probability"]["maximum"] == 1.0  # a sampler plugin's own option, from its declaration
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["temperature"] == {"type": "number", "minimum": 0, "maximum": 2}
    assert chat["top_k"]["minimum"] == -1
    assert schemas["ChatRequest"]["properties"]["model"]["pattern"] == name_pattern()


@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [("temperature", 2.5, False), ("temperature", 2, True), ("top_p", -0.1, False), ("max_tokens", 0, False), ("top_k", -2, False),
     ("min_p", 1.5, False), ("dry_base", 0.5, False), ("frequency_penalty", -2, True)],
)  # fmt: skip
async def test_openai_fields_are_refused_where_the_schema_refuses_them(client, field, value, valid):
    schema = (await client.get("/openapi.json")).json()["components"]["schemas"]["ChatCompletionRequest"]["properties"][field]
    assert jsonschema.Draft202012Validator(schema).is_valid(value) == valid
    body = {"model": TINY_LLAMA, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, field: value}
    response = await client.post("/v1/chat/completions", json=body)
    assert (response.status_code == 200) == valid, response.text
    if not valid:
        assert response.status_code == 400 and field in response.json()["error"]["message"]


# --- error bodies name no server path ------------------------------------------------------------------------


def test_public_messages_name_blobs_by_digest_and_files_by_name():
    blob = "/srv/corral/models/blobs/sha256-" + "ab" * 32
    assert public_message(f"{blob}: architecture 'x' is not supported") == f"sha256:{'ab' * 32}: architecture 'x' is not supported"
    assert public_message("FROM ./m.gguf: no such file /home/me/models/m.gguf") == "FROM ./m.gguf: no such file m.gguf"
    assert public_message("upload it with POST /api/blobs/sha256:00") == "upload it with POST /api/blobs/sha256:00"


async def test_an_unreadable_body_then_a_request_on_the_same_connection_both_answer(client):
    # A 405 answered without reading the body used to leave it on the connection, stalling the next request.
    for _ in range(4):
        with trio.fail_after(20):
            response = await client.request("PATCH", "/api/show", content=json.dumps({"model": "x"}))
        assert response.status_code == 405


async def test_a_nan_keep_alive_is_a_400(client):
    response = await client.post("/api/generate", json={"model": TINY_LLAMA, "keep_alive": "nan"})
    assert response.status_code == 400 and "keep_alive" in response.json()["error"]
