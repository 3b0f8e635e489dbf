"""Modelfiles: parsing every instruction, errors with line numbers, rendering, and the layers create writes."""

import json
import re
from pathlib import Path

import pytest

from corral.errors import InvalidModelNameError, ModelNotFoundError
from corral.modelfile.create import CreateModelError, ModelSpec, create_model, validate_parameters
from corral.modelfile.defaults import format_parameters, model_defaults
from corral.modelfile.syntax import Message, Modelfile, ModelfileError, is_go_template
from corral.options import InvalidOptionError
from corral.store import (
    LICENSE_MEDIA_TYPE,
    MESSAGES_MEDIA_TYPE,
    MODEL_MEDIA_TYPE,
    PARAMS_MEDIA_TYPE,
    SYSTEM_MEDIA_TYPE,
    TEMPLATE_MEDIA_TYPE,
    Store,
)
from tiny_gguf import write_tiny_llama


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("FROM smollm2", Modelfile("smollm2")),
        ("from smollm2\n", Modelfile("smollm2")),
        ("FROM ./model.gguf", Modelfile("./model.gguf")),
        ("FROM m\nPARAMETER temperature 0.2", Modelfile("m", {"temperature": 0.2})),
        ("FROM m\nPARAMETER num_ctx 2048", Modelfile("m", {"num_ctx": 2048})),
        ("FROM m\nPARAMETER seed -1", Modelfile("m", {"seed": -1})),
        ("FROM m\nPARAMETER temperature 1", Modelfile("m", {"temperature": 1.0})),
        ("FROM m\nparameter TOP_K 10", Modelfile("m", {"top_k": 10})),
        ("FROM m\nPARAMETER top_k 10\nPARAMETER top_k 20", Modelfile("m", {"top_k": 20})),
        (
            'FROM m\nPARAMETER stop "<|im_end|>"\nPARAMETER stop <end>',
            Modelfile("m", {"stop": ["<|im_end|>", "<end>"]}),
        ),
        ("FROM m\nPARAMETER mirostat 1", Modelfile("m", {"mirostat": 1})),
        ("FROM m\nPARAMETER use_mmap true", Modelfile("m")),
        ("FROM m\nTEMPLATE {{ messages }}", Modelfile("m", template="{{ messages }}")),
        ("FROM m\nSYSTEM You are terse.", Modelfile("m", system="You are terse.")),
        ("FROM m\nSYSTEM first\nSYSTEM second", Modelfile("m", system="second")),
        ('FROM m\nSYSTEM ""', Modelfile("m", system="")),
        ('FROM m\nSYSTEM "  padded "', Modelfile("m", system="  padded ")),
        ('FROM m\nSYSTEM "one\ntwo"', Modelfile("m", system="one\ntwo")),
        ('FROM m\nSYSTEM """say "hi"\nnow"""', Modelfile("m", system='say "hi"\nnow')),
        ('FROM m\nSYSTEM """\nblock\n"""\n', Modelfile("m", system="\nblock\n")),
        ('FROM m\nSYSTEM """a""" b """c"""', Modelfile("m", system='a""" b """c')),
        ("FROM m\nLICENSE MIT\nLICENSE Apache", Modelfile("m", license=("MIT", "Apache"))),
        (
            "FROM m\nMESSAGE user Is it?\nMESSAGE Assistant Yes.",
            Modelfile("m", messages=(Message("user", "Is it?"), Message("assistant", "Yes."))),
        ),
        ('FROM m\nMESSAGE system """multi\nline"""', Modelfile("m", messages=(Message("system", "multi\nline"),))),
        ("# a comment\n\n  # indented comment\nFROM m # not a comment", Modelfile("m # not a comment")),
        ("\ufeffFROM m\r\nSYSTEM s\r\n", Modelfile("m", system="s")),
        ("FROM m\n\tSYSTEM\t tabbed  ", Modelfile("m", system="tabbed")),
    ],
)
def test_parse(text, expected):
    assert Modelfile.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "line", "says"),
    [
        ("FROM m\nFOO bar", 2, "unknown instruction 'FOO'"),
        ("FROM m\n\n# c\nfrom: m", 4, "unknown instruction 'from:'"),
        ("FROM\n", 1, "FROM needs a value"),
        ("FROM m\nSYSTEM   \n", 2, "SYSTEM needs a value"),
        ("FROM m\nPARAMETER\ntemperature 1", 2, "needs a name and a value"),
        ("FROM m\nPARAMETER temperature", 2, "PARAMETER temperature needs a value"),
        ("FROM m\nPARAMETER temp 0.5", 2, "unknown parameter 'temp'"),
        ("FROM m\nPARAMETER num_ctx lots", 2, "must be an integer"),
        ("FROM m\nPARAMETER num_ctx 1.5", 2, "must be an integer"),
        ("FROM m\nPARAMETER temperature warm", 2, "must be a number"),
        ("FROM m\nPARAMETER top_p 2", 2, "'top_p' must be >= 0.0 and <= 1.0"),
        ("FROM m\nPARAMETER temperature nan", 2, "'temperature' must be a number"),
        ("FROM m\nMESSAGE tool hi", 2, "role 'tool' must be one of system, user, assistant"),
        ("FROM m\nMESSAGE user", 2, "MESSAGE user needs a value"),
        ("FROM m\nADAPTER ./lora.gguf", 2, "ADAPTER is not supported"),
        ("FROM m\nFROM p.gguf\nFROM n", 3, "at most two FROM lines"),
        ('FROM m\nSYSTEM """open\nstill open\n', 2, 'opened with """ is never closed'),
        ('FROM m\n\nTEMPLATE "open', 3, 'opened with " is never closed'),
    ],
)
def test_parse_errors_name_the_line(text, line, says):
    with pytest.raises(ModelfileError, match=f"^Modelfile line {line}: .*{re.escape(says)}") as caught:
        Modelfile.parse(text)
    assert caught.value.line == line


def test_parse_without_from_is_an_error():
    with pytest.raises(ModelfileError, match="no FROM line"):
        Modelfile.parse("SYSTEM hi\n")


@pytest.mark.parametrize(
    "modelfile",
    [
        Modelfile("smollm2"),
        Modelfile(
            "/models/tiny.gguf",
            {"temperature": 0.25, "num_ctx": 512, "stop": ["<|im_end|>", " padded ", '"quoted"']},
            template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
            system='You are "Bob".\nBe terse.',
            messages=(Message("user", "hi"), Message("assistant", " spaced ")),
            license=("MIT", "line one\nline two", ""),
        ),
        Modelfile("m", system=""),
        Modelfile("m", system='"starts with a quote'),
        Modelfile("m", system='ends with a quote"'),
    ],
)
def test_render_parses_back_to_the_same_modelfile(modelfile):
    assert Modelfile.parse(modelfile.render()) == modelfile


def test_render_writes_instructions_in_ollama_order():
    modelfile = Modelfile("m", {"top_k": 5}, template="t", system="s", messages=(Message("user", "u"),), license=("l",))
    text = modelfile.render()
    assert text == "FROM m\nTEMPLATE t\nSYSTEM s\nPARAMETER top_k 5\nLICENSE l\nMESSAGE user u\n"


def test_validate_parameters_types_and_rejects_unknown_names():
    assert validate_parameters({"temperature": 1, "stop": "x", "seed": None, "mirostat": 2, "numa": True}) == {
        "temperature": 1.0,
        "stop": ["x"],
        "mirostat": 2,
    }
    with pytest.raises(InvalidOptionError, match="unknown parameter 'temp'"):
        validate_parameters({"temp": 1})
    with pytest.raises(InvalidOptionError, match="'top_k' must be an integer"):
        validate_parameters({"top_k": "many"})


def test_format_parameters_quotes_strings_like_ollama_show():
    assert format_parameters({"stop": ["<a>", "<b>"], "temperature": 0.5}) == (
        f'{"stop":<30} "<a>"\n{"stop":<30} "<b>"\n{"temperature":<30} 0.5'
    )


@pytest.mark.parametrize(
    ("template", "go"),
    [
        ("{{ .System }} {{ .Prompt }}", True),
        ("{{- range .Messages }}{{ .Content }}{{ end }}", True),
        ("{{ if .System }}x{{ end }}", True),
        ("{% for message in messages %}{{ message['content'] }}{% endfor %}", False),
        ("{{ bos_token }}{{ messages[0].content }}", False),
    ],
)
def test_is_go_template(template, go):
    assert is_go_template(template) is go


# --- create and model_defaults over a store ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_from_a_gguf_path_resolves_relative_to_the_modelfile(tmp_path, tiny_gguf):
    (tmp_path / "tiny.gguf").write_bytes(open(tiny_gguf, "rb").read())
    assert ModelSpec.from_modelfile(Modelfile.parse("FROM ./tiny.gguf"), tmp_path).gguf_path == tmp_path / "tiny.gguf"
    assert ModelSpec.from_modelfile(Modelfile.parse("FROM tiny.gguf"), tmp_path).gguf_path == tmp_path / "tiny.gguf"
    assert ModelSpec.from_modelfile(Modelfile.parse(f"FROM {tiny_gguf}")).gguf_path == Path(tiny_gguf).resolve()


def test_from_a_name_is_a_model_and_a_missing_path_is_an_error(tmp_path):
    assert ModelSpec.from_modelfile(Modelfile.parse("FROM me/base:v1"), tmp_path).from_model == "me/base:v1"
    with pytest.raises(ModelfileError, match="no such file"):
        ModelSpec.from_modelfile(Modelfile.parse("FROM ./absent.gguf"), tmp_path)
    with pytest.raises(ModelfileError, match="needs the Modelfile's directory"):
        ModelSpec.from_modelfile(Modelfile.parse("FROM absent.gguf"))
    # A directory is a Hugging Face folder to convert; create checks it (test_convert.py).
    assert ModelSpec.from_modelfile(Modelfile.parse(f"FROM {tmp_path}")).hf_folder == tmp_path.resolve()


def test_model_defaults_read_back_what_the_modelfile_set(tmp_path, tiny_gguf):
    store = Store(tmp_path / "models")
    text = f"""
FROM {tiny_gguf}
PARAMETER temperature 0.1
PARAMETER stop <end>
SYSTEM You are terse.
TEMPLATE {{{{ messages }}}}
MESSAGE user Hi
MESSAGE assistant Hello.
LICENSE MIT
"""
    events = []
    create_model(store, "tiny", ModelSpec.from_modelfile(Modelfile.parse(text)), events.append)
    defaults = model_defaults(store, "tiny")
    assert defaults.options == {"temperature": 0.1, "stop": ["<end>"]}
    assert defaults.system == "You are terse."
    assert defaults.template == "{{ messages }}"
    assert defaults.messages == (Message("user", "Hi"), Message("assistant", "Hello."))
    assert defaults.license == ("MIT",)
    assert events[0] == {"status": "parsing GGUF"}
    assert events[-2:] == [{"status": "writing manifest"}, {"status": "success"}]
    assert sum(event["status"].startswith("creating new layer") for event in events) == 6


def test_created_manifest_holds_one_layer_per_kind(tmp_path, tiny_gguf):
    store = Store(tmp_path / "models")
    spec = ModelSpec(gguf_path=tiny_gguf, system="s", parameters={"top_k": 5}, messages=(Message("user", "u"),))
    manifest = create_model(store, "tiny", spec)
    kinds = [layer.media_type for layer in manifest.layers]
    assert kinds == [MODEL_MEDIA_TYPE, SYSTEM_MEDIA_TYPE, PARAMS_MEDIA_TYPE, MESSAGES_MEDIA_TYPE]
    params = store.blob_path(manifest.layer(PARAMS_MEDIA_TYPE).digest).read_text()
    assert json.loads(params) == {"top_k": 5}
    assert store.model_path("tiny").read_bytes() == open(tiny_gguf, "rb").read()


def test_derived_model_inherits_layers_and_merges_parameters(tmp_path, tiny_gguf):
    store = Store(tmp_path / "models")
    base = create_model(
        store, "base", ModelSpec(gguf_path=tiny_gguf, template="T", system="S", parameters={"top_k": 5, "seed": 3})
    )
    derived = create_model(store, "derived", ModelSpec(from_model="base", system="S2", parameters={"seed": 7}))
    assert derived.model == base.model
    assert derived.layer(TEMPLATE_MEDIA_TYPE) == base.layer(TEMPLATE_MEDIA_TYPE)
    defaults = model_defaults(store, "derived")
    assert (defaults.system, defaults.template) == ("S2", "T")
    assert defaults.options == {"seed": 7, "top_k": 5}
    assert model_defaults(store, "base").system == "S"


def test_empty_text_removes_an_inherited_layer(tmp_path, tiny_gguf):
    store = Store(tmp_path / "models")
    create_model(store, "base", ModelSpec(gguf_path=tiny_gguf, system="S", parameters={"top_k": 5}))
    create_model(store, "plain", ModelSpec(from_model="base", system=""))
    assert model_defaults(store, "plain").system is None
    assert model_defaults(store, "plain").options == {"top_k": 5}


def test_licenses_add_to_the_base_without_duplicates(tmp_path, tiny_gguf):
    store = Store(tmp_path / "models")
    create_model(store, "base", ModelSpec(gguf_path=tiny_gguf, license=("MIT",)))
    manifest = create_model(store, "derived", ModelSpec(from_model="base", license=("MIT", "extra")))
    assert [layer.media_type for layer in manifest.layers].count(LICENSE_MEDIA_TYPE) == 2
    assert model_defaults(store, "derived").license == ("MIT", "extra")


def test_create_is_idempotent_and_reuses_layers(tmp_path, tiny_gguf):
    store = Store(tmp_path / "models")
    spec = ModelSpec(gguf_path=tiny_gguf, system="S", parameters={"top_k": 5})
    first = create_model(store, "tiny", spec)
    events = []
    second = create_model(store, "tiny", spec, events.append)
    assert second.digest == first.digest
    assert not any(event["status"].startswith("creating new layer") for event in events)
    assert sum(event["status"].startswith("using existing layer") for event in events) == 3


def test_recreating_a_name_removes_blobs_only_its_old_manifest_used(tmp_path, tiny_gguf):
    store = Store(tmp_path / "models")
    old = create_model(store, "tiny", ModelSpec(gguf_path=tiny_gguf, system="old"))
    create_model(store, "tiny", ModelSpec(gguf_path=tiny_gguf, system="new"))
    assert not store.has_blob(old.layer(SYSTEM_MEDIA_TYPE).digest)
    assert store.has_blob(old.model.digest)


def test_create_from_an_unknown_model_is_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="model 'absent:latest' not found"):
        create_model(Store(tmp_path), "x", ModelSpec(from_model="absent"))


def test_create_from_a_file_that_is_not_gguf_writes_nothing(tmp_path):
    store = Store(tmp_path / "models")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(CreateModelError, match="is not a usable GGUF model: not a GGUF file"):
        create_model(store, "x", ModelSpec(gguf_path=junk))
    assert store.manifest("x") is None
    assert not store.blobs_dir.exists() or not any(store.blobs_dir.iterdir())


def test_create_from_a_missing_blob_says_to_upload_it(tmp_path):
    digest = "sha256:" + "0" * 64
    with pytest.raises(CreateModelError, match=f"upload it with POST /api/blobs/{digest}"):
        create_model(Store(tmp_path), "x", ModelSpec(gguf_blob=digest))


def test_create_with_a_bad_name_writes_nothing(tmp_path, tiny_gguf):
    store = Store(tmp_path / "models")
    with pytest.raises(InvalidModelNameError):
        create_model(store, "../escape", ModelSpec(gguf_path=tiny_gguf))
    assert not store.root.exists()


def test_spec_needs_exactly_one_base():
    with pytest.raises(CreateModelError, match="exactly one base"):
        ModelSpec()
    with pytest.raises(CreateModelError, match="exactly one base"):
        ModelSpec(from_model="a", gguf_blob="sha256:" + "0" * 64)


def test_model_defaults_skip_bad_stored_values(tmp_path, tiny_gguf):
    store = Store(tmp_path / "models")
    manifest = create_model(store, "tiny", ModelSpec(gguf_path=tiny_gguf))
    params = store.write_blob(json.dumps({"top_k": "many", "temperature": 0.5, "mirostat": 1, "numa": True}).encode())
    messages = store.write_blob(b'[{"role": "robot", "content": "x"}]')
    layers = [(MODEL_MEDIA_TYPE, manifest.model.digest), (PARAMS_MEDIA_TYPE, params), (MESSAGES_MEDIA_TYPE, messages)]
    store.write_manifest("odd", layers)
    defaults = model_defaults(store, "odd")
    assert defaults.options == {"temperature": 0.5, "mirostat": 1}
    assert defaults.messages == ()


def test_model_defaults_of_an_unknown_model_is_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError):
        model_defaults(Store(tmp_path), "absent")


def test_merge_options_lets_the_request_win_except_nulls(tmp_path, tiny_gguf):
    store = Store(tmp_path / "models")
    create_model(store, "tiny", ModelSpec(gguf_path=tiny_gguf, parameters={"temperature": 0.1, "top_k": 5}))
    defaults = model_defaults(store, "tiny")
    assert defaults.merge_options({"temperature": 0.9, "top_k": None}) == {"temperature": 0.9, "top_k": 5}


def test_to_modelfile_recreates_the_model(tmp_path, tiny_gguf):
    store = Store(tmp_path / "models")
    spec = ModelSpec(gguf_path=tiny_gguf, system="S", parameters={"stop": ["a", "b"]}, license=("MIT",))
    first = create_model(store, "tiny", spec)
    text = model_defaults(store, "tiny").to_modelfile(str(store.model_path("tiny"))).render()
    second = create_model(store, "again", ModelSpec.from_modelfile(Modelfile.parse(text)))
    assert second.digest == first.digest
