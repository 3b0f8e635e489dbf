"""The CLI as a client of a server: against a live one (real model), a scripted one, and none at all."""

import functools
import hashlib
import json
import socket

import httpx
import pytest
import trio
from click.testing import CliRunner

from corral.cli import main
from corral.client import Client, ServerError, base_url_from_env

QUESTION = "What is the capital of France?"


def unused_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def _refuse_in_process(*args, **kwargs):
    raise AssertionError("the CLI ran the model in-process instead of through the server")


@pytest.fixture
def cli(server, monkeypatch, tmp_path):
    """Runs the CLI in a worker thread against the live server; falling back to in-process fails the test."""
    monkeypatch.setenv("CORRAL_HOST", server.removeprefix("http://"))
    monkeypatch.setenv("CORRAL_MODELS", str(tmp_path / "empty-store"))  # the CLI's own store stays empty
    monkeypatch.setattr("corral.cli.backends.LocalChat", _refuse_in_process)
    monkeypatch.setattr("corral.cli.backends.pull_in_process_if_missing", _refuse_in_process)

    async def invoke(*args, input=None):
        call = functools.partial(CliRunner().invoke, main, [str(a) for a in args], input=input, catch_exceptions=False)
        return await trio.to_thread.run_sync(call)

    return invoke


@pytest.fixture
def interactive(monkeypatch):
    monkeypatch.setattr("corral.cli.commands.stdin_is_interactive", lambda: True)


# ---- against a live server --------------------------------------------------------------------


async def test_run_answers_through_the_server(cli):
    result = await cli("run", "smollm2", QUESTION, "--temperature", 0, "--num-predict", 24)
    assert result.exit_code == 0, result.output
    assert "Paris" in result.output


async def test_run_interactive_sets_parameters_and_reads_multiline_input(cli, interactive):
    script = '/set parameter temperature 0\n"""What is the capital\nof France?\n"""\n/bye\nnever read\n'
    result = await cli("run", "smollm2", "--num-predict", 24, input=script)
    assert result.exit_code == 0, result.output
    assert "Set parameter 'temperature' to '0'" in result.output
    assert result.output.count(">>>") == 3 and result.output.count("...") >= 2
    assert "Paris" in result.output


async def test_list_shows_the_servers_models(cli):
    result = await cli("list")
    assert result.exit_code == 0, result.output
    assert "smollm2:latest" in result.output and "gemma3:270m" in result.output
    assert result.output.split()[:4] == ["NAME", "ID", "SIZE", "MODIFIED"]


async def test_ps_shows_the_model_a_run_loaded(cli):
    assert (await cli("ps")).output.count("smollm2") == 0
    await cli("run", "smollm2", "Hi", "--num-predict", 1)
    result = await cli("ps")
    assert result.exit_code == 0, result.output
    assert result.output.split()[:6] == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
    assert "smollm2:latest" in result.output and "from now" in result.output


async def test_show_prints_the_model_details(cli):
    result = await cli("show", "smollm2")
    assert result.exit_code == 0, result.output
    for expected in ("architecture", "llama", "context length", "Q4_1", "completion"):
        assert expected in result.output


async def test_show_template_prints_the_chat_template(cli):
    result = await cli("show", "smollm2", "--template")
    assert result.exit_code == 0, result.output
    assert "<|im_start|>" in result.output and "architecture" not in result.output


async def test_show_unknown_model_is_a_clear_error(cli):
    result = await cli("show", "no-such-model")
    assert result.exit_code == 1
    assert "no-such-model" in result.output and "not found" in result.output


async def test_cp_then_rm_through_the_server(cli):
    copied = await cli("cp", "smollm2", "my-copy")
    assert copied.exit_code == 0 and "copied 'smollm2' to 'my-copy'" in copied.output
    assert "my-copy:latest" in (await cli("list")).output
    removed = await cli("rm", "my-copy")
    assert removed.exit_code == 0 and "deleted 'my-copy'" in removed.output
    listing = (await cli("list")).output
    assert "my-copy" not in listing and "smollm2:latest" in listing


async def test_stop_unloads_the_model(cli):
    await cli("run", "smollm2", "Hi", "--num-predict", 1)
    result = await cli("stop", "smollm2")
    assert result.exit_code == 0, result.output
    assert "smollm2" not in (await cli("ps")).output


async def test_stop_a_model_that_is_not_running_is_an_error(cli):
    result = await cli("stop", "smollm2")
    assert result.exit_code == 1
    assert "couldn't find model 'smollm2' to stop" in result.output


async def test_create_from_a_modelfile_adds_the_model(cli, tmp_path):
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text("FROM smollm2\nSYSTEM You are a pirate.\nPARAMETER temperature 0\n")
    result = await cli("create", "pirate", "-f", modelfile)
    assert result.exit_code == 0, result.output
    assert "success" in result.output
    assert "pirate:latest" in (await cli("list")).output


async def test_create_from_a_gguf_next_to_the_modelfile(cli, tmp_path, smollm2_path, monkeypatch):
    (tmp_path / "weights.gguf").symlink_to(smollm2_path)
    (tmp_path / "Modelfile").write_text("FROM ./weights.gguf\n")
    monkeypatch.chdir("/")
    result = await cli("create", "from-file", "-f", tmp_path / "Modelfile")
    assert result.exit_code == 0, result.output
    assert "from-file:latest" in (await cli("list")).output


async def test_show_reports_a_created_models_system_message(cli, tmp_path):
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text("FROM smollm2\nSYSTEM You are a pirate.\n")
    assert (await cli("create", "pirate", "-f", modelfile)).exit_code == 0
    assert "You are a pirate." in (await cli("show", "pirate", "--system")).output


async def test_pull_through_the_server_verifies_a_present_model(cli):
    result = await cli("pull", "smollm2")
    assert result.exit_code == 0, result.output
    assert "success" in result.output


async def test_pull_unknown_model_is_a_clear_error(cli):
    result = await cli("pull", "no-such-model")
    assert result.exit_code == 1
    assert result.output.startswith("Error:") and "no-such-model" in result.output and "not found" in result.output


# ---- with no server ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args", [["ps"], ["show", "smollm2"], ["stop", "smollm2"], ["create", "x", "-f", "Modelfile"]], ids=lambda a: a[0]
)
def test_commands_that_need_a_server_say_to_start_one(args, monkeypatch, tmp_path):
    monkeypatch.setenv("CORRAL_HOST", unused_address())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Modelfile").write_text("FROM smollm2\n")
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert "could not connect" in result.output and "corral serve" in result.output


# ---- against a scripted server ----------------------------------------------------------------


def ndjson(*items: dict) -> httpx.Response:
    body = "".join(json.dumps(item) + "\n" for item in items)
    return httpx.Response(200, headers={"content-type": "application/x-ndjson"}, content=body)


def reply(text: str) -> httpx.Response:
    return ndjson(
        {"message": {"role": "assistant", "content": text}, "done": False},
        {"message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "stop",
         "total_duration": 2_000_000_000, "eval_count": 10, "eval_duration": 500_000_000},
    )  # fmt: skip


class ScriptedServer:
    """An httpx transport answering from a table of routes, recording (method, path, body) of each request."""

    def __init__(self, routes: dict):
        self.routes = {"GET /": lambda body: httpx.Response(200, text="corral is running"), **routes}
        self.requests: list[tuple[str, str, object]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        raw = request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw
        self.requests.append((request.method, request.url.path, body))
        route = self.routes.get(f"{request.method} {request.url.path}")
        if route is None:
            return httpx.Response(404, json={"error": "no such route"})
        return route(body)

    def bodies(self, path: str) -> list:
        return [body for _, p, body in self.requests if p == path]


@pytest.fixture
def scripted(monkeypatch):
    """Points the CLI's Client at a ScriptedServer built from the routes given."""

    def install(routes: dict) -> ScriptedServer:
        scripted_server = ScriptedServer(routes)
        scripted_client = functools.partial(Client, transport=httpx.MockTransport(scripted_server))
        for module in ("corral.cli.commands", "corral.cli.backends"):  # the commands' own clients, and running_server's
            monkeypatch.setattr(f"{module}.Client", scripted_client)
        return scripted_server

    return install


SHOW_OK = {"POST /api/show": lambda body: httpx.Response(200, json={"details": {}, "model_info": {}})}


def test_run_pulls_a_missing_model_through_the_server_first(scripted):
    server = scripted({
        "POST /api/show": lambda body: httpx.Response(404, json={"error": "model 'tiny' not found"}),
        "POST /api/pull": lambda body: ndjson({"status": "pulling manifest"}, {"status": "pulling abc", "total": 10, "completed": 10}, {"status": "success"}),
        "POST /api/chat": lambda body: reply("Bonjour"),
    })  # fmt: skip
    result = CliRunner().invoke(main, ["run", "tiny", "Hi"])
    assert result.exit_code == 0, result.output
    assert "Bonjour" in result.output and "success" in result.output
    assert [path for _, path, _ in server.requests] == ["/", "/api/show", "/api/pull", "/api/chat"]


def test_run_sends_only_the_options_given(scripted):
    server = scripted(SHOW_OK | {"POST /api/chat": lambda body: reply("ok")})
    CliRunner().invoke(main, ["run", "tiny", "Hi", "there", "--temperature", "0", "--seed", "7", "--keepalive", "10m"])
    (body,) = server.bodies("/api/chat")
    assert body["options"] == {"temperature": 0.0, "seed": 7}
    assert body["keep_alive"] == "10m" and body["messages"] == [{"role": "user", "content": "Hi there"}]


def test_interactive_chat_sends_the_history_after_the_system_message(scripted, interactive):
    answers = iter(["First answer", "Second answer"])
    server = scripted(SHOW_OK | {
        "POST /api/generate": lambda body: httpx.Response(200, json={"done": True, "done_reason": "load"}),
        "POST /api/chat": lambda body: reply(next(answers)),
    })  # fmt: skip
    result = CliRunner().invoke(main, ["run", "tiny"], input="/set system Be brief.\nOne\nTwo\n")
    assert result.exit_code == 0, result.output
    assert server.bodies("/api/chat")[-1]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": "First answer"},
        {"role": "user", "content": "Two"},
    ]


def test_interactive_clear_forgets_the_history(scripted, interactive):
    server = scripted(SHOW_OK | {"POST /api/generate": lambda body: httpx.Response(200, json={"done": True}), "POST /api/chat": lambda body: reply("ok")})
    CliRunner().invoke(main, ["run", "tiny"], input="One\n/clear\nTwo\n/bye\n")
    assert server.bodies("/api/chat")[-1]["messages"] == [{"role": "user", "content": "Two"}]


def test_interactive_set_parameter_types_and_checks_values(scripted, interactive):
    server = scripted(SHOW_OK | {"POST /api/generate": lambda body: httpx.Response(200, json={"done": True}), "POST /api/chat": lambda body: reply("ok")})
    script = (
        "/set parameter top_k 5\n/set parameter stop <a> <b>\n/set parameter ignore_eos T\n"
        "/set parameter temperature warm\n/set parameter bogus 1\nHi\n"
    )
    result = CliRunner().invoke(main, ["run", "tiny"], input=script)
    assert server.bodies("/api/chat")[-1]["options"] == {"top_k": 5, "stop": ["<a>", "<b>"], "ignore_eos": True}
    assert "Couldn't set parameter: parameter 'temperature' must be a number" in result.output
    assert "Couldn't set parameter: unknown parameter 'bogus'" in result.output


def test_interactive_keeps_chatting_after_a_server_error(scripted, interactive):
    answers = iter([httpx.Response(400, json={"error": "prompt too long"}), reply("fine")])
    server = scripted(SHOW_OK | {"POST /api/generate": lambda body: httpx.Response(200, json={"done": True}), "POST /api/chat": lambda body: next(answers)})
    result = CliRunner().invoke(main, ["run", "tiny"], input="One\nTwo\n")
    assert result.exit_code == 0
    assert "Error: prompt too long" in result.output and "fine" in result.output
    assert server.bodies("/api/chat")[-1]["messages"] == [{"role": "user", "content": "Two"}]


def test_verbose_prints_the_servers_timings(scripted):
    scripted(SHOW_OK | {"POST /api/chat": lambda body: reply("ok")})
    result = CliRunner().invoke(main, ["run", "tiny", "Hi", "--verbose"])
    assert "total duration:       2.000s" in result.output
    assert "eval rate:            20.00 tokens/s" in result.output


def test_an_error_in_the_stream_is_one_line_and_exit_1(scripted):
    scripted(SHOW_OK | {"POST /api/chat": lambda body: ndjson({"message": {"content": "Par"}, "done": False}, {"error": "model crashed"})})
    result = CliRunner().invoke(main, ["run", "tiny", "Hi"])
    assert result.exit_code == 1
    assert "Par" in result.output and "Error: model crashed" in result.output


def test_create_uploads_a_local_gguf_and_sends_the_modelfile_fields(scripted, tmp_path, monkeypatch):
    (tmp_path / "weights.gguf").write_bytes(b"GGUF fake weights")
    (tmp_path / "Modelfile").write_text(
        'FROM ./weights.gguf\nPARAMETER temperature 0.2\nPARAMETER stop "<end>"\nPARAMETER stop "<eot>"\n'
        'SYSTEM """You are\na pirate."""\nMESSAGE user Ahoy?\nMESSAGE assistant Arr!\n'
    )
    digest = "sha256:" + hashlib.sha256(b"GGUF fake weights").hexdigest()
    server = scripted({
        f"HEAD /api/blobs/{digest}": lambda body: httpx.Response(404),
        f"POST /api/blobs/{digest}": lambda body: httpx.Response(201),
        "POST /api/create": lambda body: ndjson({"status": "writing manifest"}, {"status": "success"}),
    })  # fmt: skip
    monkeypatch.chdir("/")  # relative FROM paths are the Modelfile's, not the working directory's
    result = CliRunner().invoke(main, ["create", "pirate", "-f", str(tmp_path / "Modelfile")])
    assert result.exit_code == 0, result.output
    assert "success" in result.output
    (upload,) = [body for method, path, body in server.requests if method == "POST" and path.startswith("/api/blobs/")]
    assert upload == b"GGUF fake weights"
    (create,) = server.bodies("/api/create")
    assert create == {
        "model": "pirate",
        "files": {"weights.gguf": digest},
        "parameters": {"temperature": 0.2, "stop": ["<end>", "<eot>"]},
        "system": "You are\na pirate.",
        "messages": [{"role": "user", "content": "Ahoy?"}, {"role": "assistant", "content": "Arr!"}],
    }


def test_create_from_a_model_name_sends_from(scripted, tmp_path):
    (tmp_path / "Modelfile").write_text("# a comment\nFROM smollm2\nTEMPLATE {{ .Prompt }}\n")
    server = scripted({"POST /api/create": lambda body: ndjson({"status": "success"})})
    CliRunner().invoke(main, ["create", "mine", "-f", str(tmp_path / "Modelfile")])
    assert server.bodies("/api/create") == [{"model": "mine", "from": "smollm2", "template": "{{ .Prompt }}"}]


# ---- the client ---------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        ("", "http://127.0.0.1:11434"),
        ("0.0.0.0", "http://127.0.0.1:11434"),
        ("example.com:8080", "http://example.com:8080"),
        ("https://example.com/", "https://example.com:11434"),
        ("[::1]:9000", "http://[::1]:9000"),
        (":9000", "http://127.0.0.1:9000"),
    ],
)
def test_base_url_follows_corral_host(value, expected, monkeypatch):
    monkeypatch.delenv("OLLAMA_HOST", raising=False)
    monkeypatch.setenv("CORRAL_HOST", value)
    assert base_url_from_env() == expected


def test_client_raises_the_servers_error_with_its_status():
    transport = httpx.MockTransport(lambda request: httpx.Response(404, json={"error": "model 'x' not found"}))
    with pytest.raises(ServerError) as caught:
        Client("http://test", transport=transport).show("x")
    assert caught.value.status == 404 and str(caught.value) == "model 'x' not found"


def test_client_is_not_running_when_nothing_listens():
    assert not Client(f"http://{unused_address()}").is_running()


def test_create_without_a_modelfile_says_so(scripted, tmp_path, monkeypatch):
    scripted({})
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["create", "mine"])
    assert result.exit_code == 1
    assert "cannot read the Modelfile Modelfile" in result.output
