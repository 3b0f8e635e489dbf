"""One decode path: `load_model().generate()`, `corral run` in-process and the server all answer through
the runtime, so stop strings, `format` and a Modelfile's defaults behave the same everywhere."""

import json
import socket

import pytest
import trio
from click.testing import CliRunner

from conftest import copy_store
from corral.cli import main
from corral.modelfile.create import ModelSpec, create_model
from corral.runner.runtime import Runtime
from corral.server.serve import serve
from corral.store import Store

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("runtime_loads_once")]  # in-process runs and servers share one load

QUESTION = "What is the capital of France?"
CAPITAL_SCHEMA = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}


@pytest.fixture
def smollm2(smollm2_path, load_once):
    return load_once(smollm2_path)


def generated(model, prompt, **kwargs) -> str:
    return "".join(model.generate(prompt, **kwargs))


async def test_generate_answers_as_the_runtime_does_greedily(smollm2):
    prompt = "Why is the sky blue?"
    blocking = await trio.to_thread.run_sync(lambda: generated(smollm2, prompt, max_tokens=32, temperature=0))
    async with Runtime.open(smollm2, num_parallel=2, num_ctx=4096) as rt:
        async with rt.generate(prompt, {"temperature": 0, "num_predict": 32}) as stream:
            text, final = await stream.collect()
    assert final.eval_count == 32
    assert blocking == text


def test_generate_stops_before_a_stop_string(smollm2):
    answer = generated(smollm2, QUESTION, max_tokens=24)
    assert "Paris" in answer
    stopped = generated(smollm2, QUESTION, max_tokens=24, options={"stop": ["Paris"]})
    assert stopped == answer[: answer.index("Paris")]


def test_generate_honours_the_runtimes_sampler_options(smollm2):
    # top_k 1 is greedy whatever the temperature: the sampler chain, not a loop of its own, draws.
    greedy = generated(smollm2, QUESTION, max_tokens=16, temperature=0)
    assert generated(smollm2, QUESTION, max_tokens=16, temperature=1.5, seed=3, options={"top_k": 1}) == greedy


def test_generate_with_a_json_schema_answers_that_json(smollm2):
    answer = generated(smollm2, QUESTION + " Answer in JSON.", max_tokens=48, format=CAPITAL_SCHEMA)
    assert isinstance(json.loads(answer)["capital"], str)


# --- corral run in-process and through the server ----------------------------------------------------


def unused_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def store_root(seeded_store_root, tmp_path, monkeypatch):
    """A fresh copy of the seeded store, with `stopper` (smollm2 with PARAMETER stop Paris) and `brief`
    (PARAMETER num_predict 3); the CLI uses it, and no server answers at CORRAL_HOST."""
    root = copy_store(seeded_store_root, tmp_path / "models")
    store = Store(root)
    create_model(store, "stopper", ModelSpec(from_model="smollm2", parameters={"stop": ["Paris"]}))
    create_model(store, "brief", ModelSpec(from_model="smollm2", parameters={"num_predict": 3}))
    monkeypatch.setenv("CORRAL_MODELS", str(root))
    monkeypatch.setenv("CORRAL_HOST", unused_address())
    return root


def run_cli(*args, input=None):
    result = CliRunner().invoke(main, [str(a) for a in args], input=input, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def answer(*args) -> str:
    """What `corral run` prints on stdout for one prompt, greedily."""
    return run_cli("run", *args, "--temperature", 0, "--num-predict", 24).stdout.strip()


def test_run_in_process_stops_before_a_modelfiles_stop_string(store_root):
    full = answer("smollm2", QUESTION)
    assert "Paris" in full
    assert answer("stopper", QUESTION) == full[: full.index("Paris")].strip()


def test_run_in_process_applies_a_modelfiles_options(store_root):
    result = CliRunner().invoke(main, ["run", "brief", QUESTION, "--verbose"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "eval count:           3 token(s)" in result.output


def test_run_in_process_with_format_json_prints_json(store_root):
    printed = answer("smollm2", QUESTION + " Answer in JSON with the key capital.", "--format", "json")
    assert isinstance(json.loads(printed), dict)


def test_run_in_process_with_a_json_schema_prints_that_json(store_root):
    printed = answer("smollm2", QUESTION + " Answer in JSON.", "--format", json.dumps(CAPITAL_SCHEMA))
    assert isinstance(json.loads(printed)["capital"], str)


def printed_after_prompts(stdout: str) -> list[str]:
    """What the session printed after each line typed at a `>>>` prompt (the typed line is echoed first)."""
    return [turn.partition("\n")[2].strip() for turn in stdout.split(">>> ")[1:]]


def test_interactive_set_parameter_stop_is_honoured_in_process(store_root, monkeypatch):
    full = answer("smollm2", QUESTION)
    monkeypatch.setattr("corral.cli.commands.stdin_is_interactive", lambda: True)
    script = f"/set parameter stop Paris\n{QUESTION}\n/bye\n"
    result = run_cli("run", "smollm2", "--temperature", 0, "--num-predict", 24, input=script)
    set_line, reply = printed_after_prompts(result.stdout)[:2]
    assert set_line == "Set parameter 'stop' to 'Paris'"
    assert reply == full[: full.index("Paris")].strip()


def test_interactive_set_format_json_is_honoured_in_process(store_root, monkeypatch):
    monkeypatch.setattr("corral.cli.commands.stdin_is_interactive", lambda: True)
    script = f"/set format json\n{QUESTION} Answer in JSON with the key capital.\n/bye\n"
    result = run_cli("run", "smollm2", "--temperature", 0, "--num-predict", 24, input=script)
    set_line, reply = printed_after_prompts(result.stdout)[:2]
    assert set_line == "Set format to 'json' mode."
    assert isinstance(json.loads(reply), dict)


def _refuse_in_process(*args, **kwargs):
    raise AssertionError("the CLI answered in-process instead of through the server")


async def test_the_server_stops_at_a_modelfiles_stop_string_as_run_in_process_does(store_root, nursery, monkeypatch):
    in_process = await trio.to_thread.run_sync(answer, "stopper", QUESTION)
    address = await nursery.start(serve, "127.0.0.1", 0, Store(store_root))
    monkeypatch.setenv("CORRAL_HOST", str(address))
    monkeypatch.setattr("corral.cli.backends.LocalChat", _refuse_in_process)
    through_server = await trio.to_thread.run_sync(answer, "stopper", QUESTION)
    assert "Paris" not in through_server and through_server
    assert through_server == in_process
