"""`corral bench --sweep`: load through the HTTP API at several concurrencies, against a second server too, and
the plot; on two live servers over the tiny models."""

import functools
import json

import pytest
import trio
from click.testing import CliRunner
from conftest import TINY_LLAMA, _serve, copy_store

from corral.cli import main
from corral.sweep import bench_prompt, parse_levels

pytestmark = pytest.mark.slow  # two servers under load: out of the fast subset (-m "not slow")


@pytest.fixture
def cli(monkeypatch):
    async def invoke(server: str, *args):
        monkeypatch.setenv("CORRAL_HOST", server.removeprefix("http://"))
        call = functools.partial(CliRunner().invoke, main, [str(a) for a in args], catch_exceptions=False)
        return await trio.to_thread.run_sync(call)

    return invoke


async def test_sweep_loads_both_servers_at_every_level_and_plots_them(cli, tiny_server, tiny_store_root, tmp_path, nursery):
    other = await _serve(copy_store(tiny_store_root, tmp_path / "other-models"), nursery)
    plot = tmp_path / "bench.png"
    result = await cli(tiny_server, "bench", TINY_LLAMA, "--sweep", "1,3", "--gen-tokens", 5, "--prompt-tokens", 16,
                       "--rounds", 2, "--against", f"other={other}", "--plot", plot, "--json")
    assert result.exit_code == 0, result.output
    points = json.loads(result.output)
    assert [(p["server"], p["concurrency"]) for p in points] == [(s, c) for s in ("corral", "other") for c in (1, 3)]
    for point in points:
        assert point["requests"] == 2 * point["concurrency"]
        assert point["generated_tokens"] == 5 * point["requests"]  # ignore_eos: every request runs to max_tokens
        assert 0 < point["p50_latency_s"] <= point["p99_latency_s"] <= point["wall_s"]
        assert point["throughput_tok_s"] == pytest.approx(point["generated_tokens"] / point["wall_s"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


async def test_sweep_prints_a_table_without_json(cli, tiny_server):
    result = await cli(tiny_server, "bench", TINY_LLAMA, "--sweep", "1", "--gen-tokens", 2, "--prompt-tokens", 8, "--rounds", 1)
    assert result.exit_code == 0, result.output
    assert "TOKENS/S" in result.output and "corral" in result.output


async def test_sweep_of_an_unknown_model_names_the_server_and_its_answer(cli, tiny_server):
    result = await cli(tiny_server, "bench", "no-such-model", "--sweep", "1")
    assert result.exit_code != 0
    assert "corral" in result.output and "404" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("text", ["", "0,1", "1,two", "-4"])
def test_bad_levels_are_refused(text):
    with pytest.raises(ValueError, match="positive integers"):
        parse_levels(text)


def test_plot_without_sweep_is_a_usage_error():
    result = CliRunner().invoke(main, ["bench", TINY_LLAMA, "--plot", "x.png"])
    assert result.exit_code == 2 and "--sweep" in result.output


def test_against_takes_a_label_or_names_the_server_by_address():
    from corral.cli.commands import _labelled

    assert _labelled("llama-server=http://127.0.0.1:8080") == ("llama-server", "http://127.0.0.1:8080")
    assert _labelled("http://127.0.0.1:8080/") == ("127.0.0.1:8080", "http://127.0.0.1:8080/")
    assert _labelled("http://h:1/?a=b") == ("h:1/?a=b", "http://h:1/?a=b")


def test_prompt_is_sized_in_words():
    assert len(bench_prompt(100).split()) == 75
