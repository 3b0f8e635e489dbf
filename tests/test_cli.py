"""The command line, driven through click's runner in-process."""

import json

from click.testing import CliRunner

from corral.cli import main


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
    monkeypatch.setattr("corral.cli.stdin_is_interactive", lambda: True)
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
