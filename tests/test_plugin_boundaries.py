"""What an architecture or a backend knows lives in its plugin: core names none of them in code."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
from tiny_gguf import write_tiny_llama

from corral.memory import estimate
from corral.model import bound_layers
from corral.plugins.architectures.gemma3 import Gemma3Model
from corral.registry import Plugins
from corral.template import CHATML

CORE = pathlib.Path(__file__).resolve().parent.parent / "core"
# GGUF names its tokenizer types after the model that introduced them (`tokenizer.ggml.model`,
# `tokenizer.ggml.pre`): values of the file format the tokenizer package reads, not architectures.
TOKENIZER_TYPES = CORE / "tokenizer"
# The converter writes those values too (`tokenizer.ggml.pre` of a Hugging Face tokenizer.json).
CONVERTER_TOKENIZER_TYPES = CORE / "convert" / "vocab.py"
# Its families read Hugging Face checkpoints, whose tensor names carry the model's prefix (`bert.`):
# the input format of a converter, not the runtime's knowledge of an architecture.
CONVERTER_FAMILIES = CORE / "convert" / "families"
# llama.cpp and its tools, named in messages that point users to them: a peer project, not an architecture.
PEER_TOOLS = re.compile(r"llama\.cpp|llama-[a-z]+(-[a-z]+)*")


def code_strings(path: pathlib.Path) -> list[str]:
    """The string constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def held_bytes(loaded) -> int:
    """What the backend holds for the model's layers (a tied embedding once per role)."""
    return sum(loaded.backend.weight_bytes(layer.weight) for layer in bound_layers(loaded.model))


def test_core_names_no_architecture_in_its_code():
    names = set(Plugins().architectures())
    assert {"llama", "gemma3"} <= names
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    found = [
        f"{path.relative_to(CORE)}: {text!r}"
        for path in sorted(CORE.rglob("*.py"))
        if TOKENIZER_TYPES not in path.parents and CONVERTER_FAMILIES not in path.parents and path != CONVERTER_TOKENIZER_TYPES
        and pattern.search(path.read_text(encoding="utf-8"))  # only a file naming one anywhere needs parsing
        for text in code_strings(path)
        if pattern.search(PEER_TOOLS.sub("", text))
    ]
    assert found == []


def test_the_default_backend_is_chosen_by_priority_not_by_name():
    plugins = Plugins()
    backend = plugins.open_backend()
    assert type(backend) is plugins.backends()["torch"]


def test_an_architecture_declares_its_default_chat_template(tmp_path):
    assert "<start_of_turn>" in Gemma3Model.default_chat_template()
    from corral.engine import load_model

    tiny = load_model(write_tiny_llama(tmp_path / "tiny.gguf"))  # llama declares none: ChatML
    assert tiny.template.source == CHATML


def test_the_memory_estimate_asks_the_architecture_and_the_backend(tmp_path):
    from corral.engine import load_model

    path = write_tiny_llama(tmp_path / "tiny.gguf")
    loaded = load_model(path)
    predicted = estimate(path, num_ctx=64, num_parallel=2, num_batch=16)
    assert predicted.weights == pytest.approx(held_bytes(loaded), rel=0.02)
    layers = loaded.model.cache_layers()
    per_cell = sum(2 * layer.kv_heads * (layer.key_dim + layer.value_dim) for layer in layers)  # bf16 keys + values
    assert predicted.kv_cache == per_cell * 64 * 2
