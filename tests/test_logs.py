"""Structured log lines and keeping secrets out of them."""

import io
import json
import logging

import pytest

from corral.logs import is_sensitive, log_environment, redacted_environment, setup_logging


@pytest.fixture
def captured(monkeypatch):
    """setup_logging's handler writing into a string; the root logger restored afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stream = io.StringIO()

    def install(**kwargs):
        setup_logging(stream=stream, **kwargs)
        return stream

    yield install
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def secrets_env(monkeypatch):
    monkeypatch.setenv("MY_API_KEY", "hunter2")
    monkeypatch.setenv("CORRAL_TOKEN", "abc")
    monkeypatch.setenv("CORRAL_MODELS", "/x")
    monkeypatch.delenv("CORRAL_LOG_FORMAT", raising=False)
    monkeypatch.delenv("CORRAL_DEBUG", raising=False)
    monkeypatch.delenv("OLLAMA_DEBUG", raising=False)


@pytest.mark.parametrize("json_lines", [False, True])
def test_secrets_never_reach_the_log(captured, secrets_env, json_lines):
    stream = captured(json=json_lines)
    log = logging.getLogger("corral.test")
    log_environment(log)
    log.info("connecting with key hunter2")
    log.warning("key %s and again %r", "hunter2", {"auth": "Bearer hunter2"}, extra={"header": "hunter2"})
    try:
        raise RuntimeError("rejected hunter2")
    except RuntimeError:
        log.exception("request failed")
    output = stream.getvalue()
    assert "hunter2" not in output
    assert "abc" not in output
    assert "CORRAL_MODELS" in output and "/x" in output
    assert output.count("***") >= 6  # CORRAL_TOKEN, the message, both arguments, the extra field, the traceback


def test_environment_dump_is_logfmt_by_default(captured, secrets_env):
    stream = captured()
    log_environment(logging.getLogger("corral.test"))
    line = stream.getvalue().strip()
    assert "level=INFO logger=corral.test msg=environment" in line
    assert "CORRAL_MODELS=/x" in line.split()
    assert "CORRAL_TOKEN=***" in line.split()
    assert "MY_API_KEY" not in line  # not a prefix corral logs


def test_json_lines_carry_fields(captured, secrets_env):
    stream = captured(json=True)
    logging.getLogger("corral.test").info("loaded %s", "smollm2", extra={"seconds": 1.5})
    log_environment(logging.getLogger("corral.test"))
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert (first["level"], first["logger"], first["msg"], first["seconds"]) == ("INFO", "corral.test", "loaded smollm2", 1.5)
    assert second["env"]["CORRAL_MODELS"] == "/x" and second["env"]["CORRAL_TOKEN"] == "***"


def test_log_format_and_debug_come_from_the_environment(captured, secrets_env, monkeypatch):
    monkeypatch.setenv("CORRAL_LOG_FORMAT", "json")
    monkeypatch.setenv("CORRAL_DEBUG", "1")
    stream = captured()
    logging.getLogger("corral.test").debug("details")
    assert json.loads(stream.getvalue())["level"] == "DEBUG"


def test_info_is_the_default_level(captured, secrets_env):
    stream = captured()
    logging.getLogger("corral.test").debug("details")
    assert stream.getvalue() == ""


def test_setting_up_twice_keeps_one_handler(captured, secrets_env):
    captured()
    stream = captured()
    logging.getLogger("corral.test").info("once")
    assert stream.getvalue().count("msg=once") == 1


def test_logfmt_quotes_values_with_spaces(captured, secrets_env):
    stream = captured()
    logging.getLogger("corral.test").info('said "hi" there', extra={"path": "/a b"})
    line = stream.getvalue()
    assert 'msg="said \\"hi\\" there"' in line and 'path="/a b"' in line


def test_redacted_environment_keeps_prefixes_and_hides_secrets():
    environ = {
        "CUDA_VISIBLE_DEVICES": "0",
        "TORCH_HOME": "/t",
        "OLLAMA_HOST": "0.0.0.0",
        "CORRAL_PASSWORD": "pw",
        "corral_secret_thing": "s",
        "HF_TOKEN": "t",
        "PATH": "/bin",
    }
    assert redacted_environment(environ) == {
        "CORRAL_PASSWORD": "***",
        "CUDA_VISIBLE_DEVICES": "0",
        "OLLAMA_HOST": "0.0.0.0",
        "TORCH_HOME": "/t",
        "corral_secret_thing": "***",
    }


@pytest.mark.parametrize(("name", "sensitive"), [("MY_API_KEY", True), ("hf_token", True), ("DB_Password", True), ("CORRAL_MODELS", False)])
def test_sensitive_names(name, sensitive):
    assert is_sensitive(name) is sensitive


def test_common_values_of_sensitive_names_are_not_scrubbed_from_text(captured, secrets_env, monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    stream = captured()
    logging.getLogger("corral.test").info("shift is false")
    assert "msg=\"shift is false\"" in stream.getvalue()
