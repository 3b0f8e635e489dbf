"""The type each tensor gets under each preset equals llama-quantize's choice (src/llama-quant.cpp).

Expected types come from llama-quantize itself: `python tests/test_quantize_mix.py` writes the tiny F32
models below, quantizes each with ~/.cache/corral-peers/build/bin/llama-quantize (built by hand from
the llama-cpp-python sdist: building it takes longer than a test may, and CI does not have it) and
records every tensor's type in tests/reference/quantize_types.json. The tests compare `mix` against
that table; where the binary is present, one more test checks the table is still what it writes.

The models have rows of 256 (so K-quants apply), 8 layers (so the first/last-eighth and every-third
rules pick different layers), a down projection of 320 columns (fallback types), tied (llama, gemma3)
and untied output (qwen3moe, deepseek2), 8 experts (the MoE rules) and MLA's fused attn_kv_b (deepseek2,
whose odd widths also take the fallbacks down to F16).
"""

from __future__ import annotations

import functools
import json
import pathlib
import shutil
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as Q

from corral.gguf import GGUFFile
from corral.quantize.driver import plan
from corral.quantize.mix import use_more_bits
from corral.quantize.presets import PRESETS, UnknownQuantizationError, preset
from tiny_gguf import write_tiny_deepseek2, write_tiny_gemma3, write_tiny_llama, write_tiny_qwen3moe

TABLE = pathlib.Path(__file__).resolve().parent / "reference" / "quantize_types.json"
LLAMA_QUANTIZE = pathlib.Path.home() / ".cache" / "corral-peers" / "build" / "bin" / "llama-quantize"

# name -> writer, config overrides, tensors the writer makes quantized that must be F32 here
MODELS = {
    "llama": (
        write_tiny_llama,
        dict(block_count=8, embedding_length=256, feed_forward_length=320, head_count=4, head_count_kv=2),
        ("blk.0.attn_q.weight", "blk.0.ffn_down.weight"),
    ),
    "gemma3": (
        write_tiny_gemma3,
        dict(block_count=8, embedding_length=256, feed_forward_length=512, key_length=64, value_length=64),
        ("blk.0.attn_q.weight", "blk.5.ffn_down.weight"),
    ),
    "qwen3moe": (
        write_tiny_qwen3moe,
        dict(block_count=4, embedding_length=256, expert_feed_forward_length=256, key_length=64, value_length=64),
        ("blk.0.attn_q.weight", "blk.1.ffn_down_exps.weight"),
    ),
    "deepseek2": (  # MLA with the fused attn_kv_b (a value projection to llama.cpp), 8 experts, odd widths
        functools.partial(write_tiny_deepseek2, fused_kv_b=True),
        dict(block_count=4, embedding_length=256),
        ("blk.1.attn_q_b.weight", "blk.2.ffn_down_exps.weight"),
    ),
}


def write_model(name: str, path: pathlib.Path) -> pathlib.Path:
    """The tiny F32 model `name` of MODELS at `path`."""
    writer, config, quantized = MODELS[name]
    writer(path, tensor_types={tensor: Q.F32 for tensor in quantized}, **config)
    return path


def llama_quantize_types(binary: pathlib.Path, source: pathlib.Path, preset_name: str, work: pathlib.Path) -> dict[str, str]:
    """Each tensor's type name in the file llama-quantize writes from `source` as `preset_name`."""
    target = work / f"{source.stem}-{preset_name}.gguf"
    subprocess.run([str(binary), str(source), str(target), preset_name], check=True, capture_output=True)
    quantized = GGUFFile.open(target)
    try:
        return {name: info.qtype.name for name, info in quantized.tensors.items()}
    finally:
        quantized.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, pathlib.Path]:
    folder = tmp_path_factory.mktemp("mix")
    return {name: write_model(name, folder / f"{name}.gguf") for name in MODELS}


@pytest.fixture(scope="module")
def table() -> dict:
    return json.loads(TABLE.read_text())


def planned_types(path: pathlib.Path, preset_name: str) -> dict[str, str]:
    source = GGUFFile.open(path)
    try:
        return {name: qtype.name for name, qtype in plan(source, preset(preset_name)).types.items()}
    finally:
        source.close()


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("preset_name", sorted(PRESETS))
def test_tensor_types_equal_llama_quantize(models, table, model, preset_name):
    assert planned_types(models[model], preset_name) == table[model][preset_name]


def test_q4_k_m_gives_q6_k_to_the_value_and_down_projections_use_more_bits_picks(table):
    types = table["gemma3"]["Q4_K_M"]
    picked = [layer for layer in range(8) if use_more_bits(layer, 8)]
    assert picked == [0, 3, 6, 7]
    assert [layer for layer in range(8) if types[f"blk.{layer}.attn_v.weight"] == "Q6_K"] == picked
    assert [layer for layer in range(8) if types[f"blk.{layer}.ffn_down.weight"] == "Q6_K"] == picked


def test_tied_embedding_gets_the_output_type_and_norms_stay_f32(table):
    types = table["llama"]["Q4_K_M"]
    assert types["token_embd.weight"] == "Q6_K"
    assert types["output_norm.weight"] == "F32"
    assert types["blk.0.ffn_down.weight"] == "Q8_0"  # 320 columns: Q6_K falls back


def test_presets_are_named_as_ollama_names_them():
    assert preset("q4_k_m") is preset("Q4_K_M") is preset("q4_K")
    with pytest.raises(UnknownQuantizationError, match=r"q8_0.*q4_K_M"):
        preset("q3_x")


@pytest.mark.peers
@pytest.mark.skipif(not LLAMA_QUANTIZE.is_file(), reason=f"llama-quantize is not built at {LLAMA_QUANTIZE}")
def test_table_is_what_llama_quantize_writes_today(models, table, tmp_path):
    for model in MODELS:
        for preset_name in ("Q4_K_M", "Q4_K_S"):
            assert llama_quantize_types(LLAMA_QUANTIZE, models[model], preset_name, tmp_path) == table[model][preset_name]


@pytest.mark.peers
@pytest.mark.skipif(not LLAMA_QUANTIZE.is_file(), reason=f"llama-quantize is not built at {LLAMA_QUANTIZE}")
@pytest.mark.parametrize("preset_name", sorted(PRESETS))
def test_quantized_file_equals_llama_quantizes_tensor_for_tensor(models, preset_name, tmp_path):
    """Types, bytes and metadata of the whole tiny llama as llama-quantize writes them (not in CI)."""
    from corral.quantize import quantize_file

    quantize_file(models["llama"], tmp_path / "ours.gguf", preset(preset_name))
    subprocess.run([str(LLAMA_QUANTIZE), str(models["llama"]), str(tmp_path / "theirs.gguf"), preset_name], check=True, capture_output=True)
    ours, theirs = GGUFFile.open(tmp_path / "ours.gguf"), GGUFFile.open(tmp_path / "theirs.gguf")
    try:
        assert ours.metadata.keys() == theirs.metadata.keys()
        assert all(str(ours.metadata[key]) == str(theirs.metadata[key]) for key in theirs.metadata)
        assert ours.tensors.keys() == theirs.tensors.keys()
        for name, info in theirs.tensors.items():
            assert ours.tensors[name].qtype == info.qtype and bytes(ours.raw(name)) == bytes(theirs.raw(name)), name
    finally:
        ours.close()
        theirs.close()


def regenerate(work: pathlib.Path) -> None:
    """Rewrite TABLE from llama-quantize's output on every model and preset."""
    if shutil.which(str(LLAMA_QUANTIZE)) is None:
        sys.exit(f"llama-quantize is not built at {LLAMA_QUANTIZE} (see ../shared/peers.md)")
    result = {}
    for model in MODELS:
        source = write_model(model, work / f"{model}.gguf")
        result[model] = {name: llama_quantize_types(LLAMA_QUANTIZE, source, name, work) for name in sorted(PRESETS)}
    TABLE.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        regenerate(pathlib.Path(work))
