"""Shared fixtures: paths to the real models and to the llama.cpp / transformers references."""

import json
import pathlib

import numpy as np
import pytest

REFERENCE = pathlib.Path(__file__).resolve().parent / "reference"


def _real_model(name: str) -> pathlib.Path:
    from corral import store

    return store.ensure_model(name)


@pytest.fixture(scope="session")
def smollm2_path() -> pathlib.Path:
    return _real_model("smollm2")


@pytest.fixture(scope="session")
def gemma3_path() -> pathlib.Path:
    return _real_model("gemma3:270m")


def reference_tokens(model: str) -> list[dict]:
    return json.loads((REFERENCE / f"tokenize_{model}.json").read_text())


def reference_logits(model: str, index: int) -> dict[str, np.ndarray]:
    return dict(np.load(REFERENCE / f"logits_{model}_{index}.npz"))
