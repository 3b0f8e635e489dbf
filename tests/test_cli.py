"""The command line, driven through click's runner in-process."""

import datetime
import json
import os
import shutil
import socket

import pytest
from click.testing import CliRunner

from corral.cli import main
from corral.cli.display import human_bytes, human_time


@pytest.fixture(autouse=True)
def no_server(monkeypatch):
    """Nothing listens at CORRAL_HOST, so the CLI works in-process (a developer's server is not used)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("CORRAL_HOST", f"127.0.0.1:{sock.getsockname()[1]}")


@pytest.fixture
def private_store(seeded_store_root, tmp_path, monkeypatch):
    """CORRAL_MODELS pointing at a fresh copy of the seeded store."""
    root = tmp_path / "models"
    shutil.copytree(seeded_store_root, root, copy_function=os.link)
    monkeypatch.setenv("CORRAL_MODELS", str(root))
    return root


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_run_answers_a_prompt_with_the_default_model(smollm2_path):
    result = invoke("run", "smollm2", "What is the capital of France?", "--temperature", 0, "--num-predict", 24)
    assert result.exit_code == 0
    assert "Paris" in result.output


def test_run_accepts_a_gguf_path(smollm2_path):
    result = invoke("run", smollm2_path, "What is the capital of France?", "--temperature", 0, "--num-predict", 12)
    assert result.exit_code == 0
    assert "Paris" in result.output


def test_run_interactive_chats_until_bye(smollm2_path, monkeypatch):
    monkeypatch.setattr("corral.cli.commands.stdin_is_interactive", lambda: True)
    result = CliRunner().invoke(
        main,
        ["run", "smollm2", "--temperature", "0", "--num-predict", "12"],
        input="What is the capital of France?\n/bye\nnever read\n",
    )
    assert result.exit_code == 0
    assert result.output.count(">>>") == 2
    assert "Paris" in result.output


def test_run_reads_a_piped_prompt(smollm2_path):
    result = CliRunner().invoke(
        main, ["run", "smollm2", "--temperature", "0", "--num-predict", "12"], input="What is the capital of France?\n"
    )
    assert result.exit_code == 0
    assert "Paris" in result.output


def test_run_unknown_model_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CORRAL_MODELS", str(tmp_path))
    result = CliRunner().invoke(main, ["run", "no-such-model", "hi"])
    assert result.exit_code == 1
    assert "no-such-model" in result.output and "not found" in result.output


def test_plugins_lists_the_builtins_with_what_they_register():
    result = invoke("plugins")
    assert result.exit_code == 0
    for expected in ("llama", "gemma3", "torch", "architectures", "backends"):
        assert expected in result.output


def test_list_shows_pulled_models(smollm2_path):
    result = invoke("list")
    assert result.exit_code == 0
    assert "smollm2" in result.output


def test_bench_prints_json_figures(smollm2_path):
    result = invoke("bench", "smollm2", "--prompt-tokens", 16, "--gen-tokens", 4, "--json")
    figures = json.loads(result.output)
    assert figures["prefill_tokens"] == 16 and figures["decode_tokens"] == 4
    assert figures["prefill_tok_s"] > 0 and figures["decode_tok_s"] > 0 and figures["peak_rss_mb"] > 0


def test_cp_and_rm_work_on_the_store_without_a_server(private_store):
    assert invoke("cp", "smollm2", "twin").exit_code == 0
    assert "twin:latest" in invoke("list").output
    removed = invoke("rm", "twin")
    assert removed.exit_code == 0 and "deleted 'twin'" in removed.output
    listing = invoke("list").output
    assert "twin" not in listing and "smollm2:latest" in listing


def test_rm_unknown_model_is_a_clear_error(private_store):
    result = CliRunner().invoke(main, ["rm", "no-such-model"])
    assert result.exit_code == 1
    assert "no-such-model" in result.output and "not found" in result.output


def test_run_refuses_a_format_that_is_neither_json_nor_a_schema():
    result = CliRunner().invoke(main, ["run", "smollm2", "Hi", "--format", "yaml"])
    assert result.exit_code == 2
    assert 'use "json" or a JSON schema object' in result.output


def test_run_rejects_a_bad_option_before_loading():
    result = CliRunner().invoke(main, ["run", "smollm2", "Hi", "--temperature", "-1"])
    assert result.exit_code == 1
    assert "temperature" in result.output


@pytest.mark.parametrize(
    "num_bytes, shown", [(512, "512 B"), (1_500, "1.5 KB"), (98_362_432, "98 MB"), (1_300_000_000, "1.3 GB"), (2_000_000_000, "2 GB")]
)
def test_sizes_read_like_ollamas(num_bytes, shown):
    assert human_bytes(num_bytes) == shown


@pytest.mark.parametrize(
    "offset, shown",
    [
        (datetime.timedelta(seconds=-30), "30 seconds ago"),
        (datetime.timedelta(seconds=-70), "About a minute ago"),
        (datetime.timedelta(minutes=4, seconds=50), "4 minutes from now"),
        (datetime.timedelta(days=-3), "3 days ago"),
        (datetime.timedelta(days=300 * 365), "Forever"),
    ],
)
def test_times_read_like_ollamas(offset, shown):
    now = datetime.datetime(2025, 1, 1, tzinfo=datetime.timezone.utc)
    assert human_time(now + offset, now) == shown
