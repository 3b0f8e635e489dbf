"""The example package examples/corral-gpt2 adds an architecture through nothing but its entry point."""

from __future__ import annotations

import importlib.metadata
import math

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from tiny_gguf import VOCAB_SIZE, write_tiny_gpt2

import corral
from corral.cli import main
from corral.errors import UnknownArchitectureError
from corral.registry import ALLOW_ENV, Plugins

pytest.importorskip("corral_gpt2", reason="the example plugin is not installed: pip install -e examples/corral-gpt2")

pytestmark = pytest.mark.usefixtures("no_allow_list_from_the_environment")


@pytest.fixture
def gpt2_path(tmp_path) -> str:
    return write_tiny_gpt2(tmp_path / "gpt2.gguf")


def test_load_model_runs_gpt2_from_the_example_package(gpt2_path):
    loaded = corral.load_model(gpt2_path, precision="fp32")
    ids = loaded.tokenize("in the hat")
    logits = loaded.logits(ids)
    assert type(loaded.model).__module__ == "corral_gpt2"
    assert loaded.info.architecture == "gpt2"
    assert logits.shape == (len(ids), VOCAB_SIZE) and np.isfinite(logits).all()


def gpt2_reference_logits(path: str, tokens: list[int]) -> np.ndarray:
    """GPT-2 written out in float64 numpy from gguf's own dequantization, as a check on the plugin."""
    reader = gguf.GGUFReader(path)
    w = {
        t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        for t in reader.tensors
    }
    blocks, heads = (int(reader.fields[f"gpt2.{key}"].contents()) for key in ("block_count", "attention.head_count"))

    def layer_norm(x, name):
        x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
        return x * w[f"{name}.weight"] + w[f"{name}.bias"]

    def linear(x, name):
        return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]

    n = len(tokens)
    x = w["token_embd.weight"][tokens].astype(np.float64) + w["position_embd.weight"][:n]
    future = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(blocks):
        qkv = linear(layer_norm(x, f"blk.{i}.attn_norm"), f"blk.{i}.attn_qkv")
        q, k, v = (part.reshape(n, heads, -1).transpose(1, 0, 2) for part in np.split(qkv, 3, axis=-1))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1]) + future
        p = np.exp(scores - scores.max(-1, keepdims=True))
        attn = (p / p.sum(-1, keepdims=True) @ v).transpose(1, 0, 2).reshape(n, -1)
        x = x + linear(attn, f"blk.{i}.attn_output")
        h = linear(layer_norm(x, f"blk.{i}.ffn_norm"), f"blk.{i}.ffn_up")
        gelu = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
        x = x + linear(gelu, f"blk.{i}.ffn_down")
    return layer_norm(x, "output_norm") @ w["token_embd.weight"].T


def test_gpt2_logits_match_a_numpy_reference(gpt2_path):
    tokens = [259, 258, 220, 71, 64, 83, 17, 200, 3]
    logits = corral.load_model(gpt2_path, precision="fp32").logits(tokens)
    expected = gpt2_reference_logits(gpt2_path, tokens)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4 * np.abs(expected).max())


def test_plugins_command_lists_gpt2_with_its_distribution_and_version():
    result = CliRunner().invoke(main, ["plugins"])
    assert result.exit_code == 0, result.output
    (row,) = [line for line in result.output.splitlines() if line.split()[:1] == ["gpt2"]]
    assert row.split()[1:3] == ["corral-gpt2", importlib.metadata.version("corral-gpt2")]
    assert "architectures: gpt2" in row


def test_allow_list_without_the_plugin_leaves_gpt2_unknown(monkeypatch, gpt2_path):
    monkeypatch.setenv(ALLOW_ENV, "torch,llama,gemma3")
    assert "gpt2" not in Plugins().architectures()
    with pytest.raises(UnknownArchitectureError, match=r"'gpt2' is not supported \(known: gemma3, llama\)"):
        corral.load_model(gpt2_path)
