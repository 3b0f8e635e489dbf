"""Models whose TEMPLATE is an Ollama Go template: created, stored, and rendering every endpoint's prompt.

The prompts are checked token for token against Ollama's own expected renders (the fixtures of
test_gotemplate_ollama): `prompt_eval_count` on the HTTP APIs, the ids themselves in the engine.
"""

from __future__ import annotations

import json
import pathlib

import httpx
import pytest

from conftest import TINY_LLAMA
from corral.engine import load_model
from corral.modelfile import ModelSpec, create_model, model_defaults
from corral.modelfile.create import CreateModelError
from corral.store import TEMPLATE_MEDIA_TYPE, Store

DATA = pathlib.Path(__file__).parent / "data" / "ollama_templates"
CHATML_GO = (DATA / "chatml.gotmpl").read_bytes().decode()
ZEPHYR_GO = (DATA / "zephyr.gotmpl").read_bytes().decode()
USER = [{"role": "user", "content": "Hello, how are you?"}]
CHAT = USER + [
    {"role": "assistant", "content": "I'm doing great. How can I help you today?"},
    {"role": "user", "content": "I'd like to show off how chat templating works!"},
]


def expected(template: str, case: str) -> str:
    return (DATA / "testdata" / template / case).read_bytes().decode()


@pytest.fixture(scope="module")
def tiny(tiny_store_root):
    """The tiny llama of the tiny store, loaded once (templates are swapped with `with_template`)."""
    return load_model(Store(tiny_store_root).model_path(TINY_LLAMA))


def test_create_stores_a_go_template_and_chats_render_through_it(tiny_store_root, tmp_path, tiny):
    store = Store(tiny_store_root)
    spec = ModelSpec(gguf_path=tiny.path, template=ZEPHYR_GO)
    manifest = create_model(Store(tmp_path / "models"), "go-zephyr", spec)
    stored = Store(tmp_path / "models")
    assert stored.blob_path(manifest.layer(TEMPLATE_MEDIA_TYPE).digest).read_bytes() == ZEPHYR_GO.encode()
    source = model_defaults(stored, "go-zephyr").chat_template("go-zephyr")
    assert source == ZEPHYR_GO
    model = tiny.with_template(source)
    assert model.template.is_go and not tiny.template.is_go
    assert model.chat_ids(CHAT) == tiny.tokenize(expected("zephyr.gotmpl", "user-assistant-user"))
    assert store.manifest(TINY_LLAMA) is not None


def test_generate_wraps_the_prompt_as_the_go_template_says(tiny):
    model = tiny.with_template(CHATML_GO)
    system = "You are a helpful assistant."
    assert model.prompt_ids("Hello, how are you?") == tiny.tokenize(expected("chatml.gotmpl", "user"))
    assert model.prompt_ids("Hi", system=system) == tiny.tokenize(
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert model.prompt_ids("<|im_start|>x", raw=True) == tiny.tokenize("<|im_start|>x")


def test_tools_and_tool_calls_reach_a_go_template(tiny):
    template = (
        "{{- range .Tools }}[{{ .Function.Name }}:{{ .Function.Parameters.Properties }}]{{ end }}"
        "{{- range .Messages }}{{ .Role }}>{{ .Content }}"
        "{{ range .ToolCalls }}{{ .Function.Name }}{{ json .Function.Arguments }}{{ end }};{{ end }}"
    )
    tools = [
        {
            "type": "function",
            "function": {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "default": "x"}}}},
        }
    ]
    messages = USER + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris", "days": 3}}}]}
    ]
    text = tiny.with_template(template).template.render(messages, tools=tools)
    # The property's unknown "default" is dropped and JSON numbers are float64, as Ollama decodes them.
    assert text == '[weather:{"city":{"type":"string"}}]user>Hello, how are you?;assistant>weather{"city":"Paris","days":3};'


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ range .Messages }}{{ upper .Content }}{{ end }}", 'function "upper" not defined'),
        ("{{ if .System }}unclosed", "unexpected EOF"),
        ("{{ .Prompt | call }}", 'function "call" not defined'),
        ('{{ template "x" }}', "undefined template specified"),
    ],
)
def test_create_refuses_a_go_template_ollama_or_corral_cannot_render(tmp_path, tiny, template, message):
    store = Store(tmp_path / "models")
    with pytest.raises(CreateModelError, match=message):
        create_model(store, "bad", ModelSpec(gguf_path=tiny.path, template=template))
    assert store.manifest("bad") is None
    assert not [path for path in (tmp_path / "models").rglob("*") if path.is_file()]  # nothing written


@pytest.fixture
async def http(tiny_server):
    async with httpx.AsyncClient(base_url=tiny_server, timeout=60) as client:
        response = await client.post("/api/create", json={"model": "go-zephyr", "from": TINY_LLAMA, "template": ZEPHYR_GO, "stream": False})
        assert response.status_code == 200, response.text
        yield client


GREEDY_ONE = {"num_predict": 1, "temperature": 0}


def prompt_ids(final: dict) -> list[int]:
    """The prompt's token ids, as /api/generate's final `context` (prompt then reply) holds them."""
    return final["context"][: final["prompt_eval_count"]]


async def test_api_chat_and_openai_prompts_are_the_go_render(http, tiny):
    # Short turns: the tiny model's context (128) would drop the oldest turns of Ollama's own conversation.
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "Ok?"}]
    text = "<|user|>\nHi</s>\n<|assistant|>\nYo</s>\n<|user|>\nOk?</s>\n<|assistant|>\n"
    tokens = len(tiny.tokenize(text))
    assert tokens != len(tiny.chat_ids(short))  # the tiny model's own (Jinja) template renders otherwise
    chat = await http.post("/api/chat", json={"model": "go-zephyr", "messages": short, "stream": False, "options": GREEDY_ONE})
    assert chat.status_code == 200, chat.text
    assert chat.json()["prompt_eval_count"] == tokens
    openai = await http.post("/v1/chat/completions", json={"model": "go-zephyr", "messages": short, "max_tokens": 1, "temperature": 0})
    assert openai.status_code == 200, openai.text
    assert openai.json()["usage"]["prompt_tokens"] == tokens


async def test_api_generate_uses_the_go_template_unless_raw(http, tiny):
    body = {"model": "go-zephyr", "prompt": "Hello, how are you?", "stream": False, "options": GREEDY_ONE}
    templated = (await http.post("/api/generate", json=body)).json()
    assert prompt_ids(templated) == tiny.tokenize(expected("zephyr.gotmpl", "user"))
    raw = await http.post("/api/generate", json=body | {"raw": True})
    assert raw.json()["prompt_eval_count"] == len(tiny.tokenize("Hello, how are you?"))


async def test_api_generate_renders_a_request_template(http, tiny):
    body = {"model": "go-zephyr", "prompt": "Hello, how are you?", "stream": False, "options": GREEDY_ONE}
    response = await http.post("/api/generate", json=body | {"template": CHATML_GO, "system": "Be brief."})
    assert response.status_code == 200, response.text
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_ids(response.json()) == tiny.tokenize(text)
    bad = await http.post("/api/generate", json=body | {"template": "{{ nope .Prompt }}"})
    assert bad.status_code == 400 and 'function "nope" not defined' in bad.json()["error"]
    raw = await http.post("/api/generate", json=body | {"template": ZEPHYR_GO, "raw": True})
    assert raw.status_code == 400


async def test_api_create_refuses_a_broken_go_template(http):
    response = await http.post(
        "/api/create", json={"model": "broken", "from": TINY_LLAMA, "template": "{{ range .Messages }}", "stream": False}
    )
    assert response.status_code == 400 and "TEMPLATE" in response.json()["error"]
    assert (await http.post("/api/show", json={"model": "broken"})).status_code == 404


async def test_a_go_template_naming_tools_gives_the_tools_capability_and_renders_them(http, tiny):
    template = "{{ if .Tools }}T:{{ .Tools }}\n{{ end }}{{ range .Messages }}{{ .Role }}: {{ .Content }}\n{{ end }}A:"
    created = await http.post("/api/create", json={"model": "go-tools", "from": TINY_LLAMA, "template": template, "stream": False})
    assert created.status_code == 200, created.text
    show = (await http.post("/api/show", json={"model": "go-tools"})).json()
    assert "tools" in show["capabilities"] and show["template"] == template
    assert "tools" not in (await http.post("/api/show", json={"model": "go-zephyr"})).json()["capabilities"]
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}}]
    body = {"model": "go-tools", "messages": [{"role": "user", "content": "Hi"}], "tools": tools, "stream": False, "options": GREEDY_ONE}
    chat = await http.post("/api/chat", json=body)
    assert chat.status_code == 200, chat.text
    text = 'T:[{"type":"function","function":{"name":"f","description":"d","parameters":{"type":"object","properties":{}}}}]\nuser: Hi\nA:'
    assert chat.json()["prompt_eval_count"] == len(tiny.tokenize(text))


async def test_api_generate_fills_in_the_middle_with_a_suffix_template(http, tiny):
    fim = json.loads((DATA / "cases.json").read_text())["TestExecuteWithSuffix"]["template"]
    created = await http.post("/api/create", json={"model": "go-fim", "from": TINY_LLAMA, "template": fim, "stream": False})
    assert created.status_code == 200, created.text
    assert "insert" in (await http.post("/api/show", json={"model": "go-fim"})).json()["capabilities"]
    body = {"model": "go-fim", "prompt": "def add(", "suffix": "return x", "stream": False, "options": GREEDY_ONE}
    response = await http.post("/api/generate", json=body)
    assert response.status_code == 200, response.text
    assert prompt_ids(response.json()) == tiny.tokenize("<PRE> def add( <SUF>return x <MID>")
    plain = await http.post("/api/generate", json=body | {"model": "go-zephyr"})
    assert plain.status_code == 400 and "does not support insert" in plain.json()["error"]


async def test_corral_create_takes_a_modelfile_with_an_ollama_template(tiny_server, http, tmp_path, monkeypatch, tiny):
    import functools

    import trio
    from click.testing import CliRunner

    from corral.cli import main

    monkeypatch.setenv("CORRAL_HOST", tiny_server.removeprefix("http://"))
    (tmp_path / "Modelfile").write_text(f'FROM {tiny.path}\nTEMPLATE """{ZEPHYR_GO}"""\nSYSTEM Be kind.\n')
    create = functools.partial(CliRunner().invoke, main, ["create", "zephyr-go", "-f", str(tmp_path / "Modelfile")])
    result = await trio.to_thread.run_sync(create)
    assert result.exit_code == 0, result.output
    shown = (await http.post("/api/show", json={"model": "zephyr-go"})).json()
    assert shown["template"] == ZEPHYR_GO and shown["system"] == "Be kind."
    chat = await http.post("/api/chat", json={"model": "zephyr-go", "messages": USER, "stream": False, "options": GREEDY_ONE})
    text = "<|system|>\nBe kind.</s>\n<|user|>\nHello, how are you?</s>\n<|assistant|>\n"
    assert chat.json()["prompt_eval_count"] == len(tiny.tokenize(text))
    (tmp_path / "Bad").write_text(f"FROM {tiny.path}\nTEMPLATE {{{{ range .Messages }}}}{{{{ oops }}}}\n")
    bad = await trio.to_thread.run_sync(functools.partial(CliRunner().invoke, main, ["create", "bad", "-f", str(tmp_path / "Bad")]))
    assert bad.exit_code != 0 and 'function "oops" not defined' in bad.output
