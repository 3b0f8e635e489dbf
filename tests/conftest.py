"""Shared fixtures: the real models (and stores and servers over them) and the llama.cpp /
transformers references.

Every test that needs a real model pulled into the store is marked `real_model`, so
`pytest -m "not real_model"` is a fast subset that runs offline with an empty store. Tests using
`smollm2_path` or `gemma3_path` (directly or through any fixture built on them: `seeded_store_root`,
`server`, ...) get the mark from `pytest_collection_modifyitems`; the few that reach a real model
another way carry it explicitly.
"""

import json
import os
import pathlib
import shutil

import numpy as np
import pytest

# Server tests run models in-process (fast, and test-registered plugins apply); the runner-process
# tests and the fault tests ask for CORRAL_RUNNER=process themselves.
os.environ.setdefault("CORRAL_RUNNER", "inprocess")

REFERENCE = pathlib.Path(__file__).resolve().parent / "reference"

# Fixtures that pull a real model into the store; everything that needs a real model depends on one.
REAL_MODEL_FIXTURES = frozenset({"smollm2_path", "gemma3_path"})


def pytest_collection_modifyitems(items):
    for item in items:
        if REAL_MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)


# --- the real models -------------------------------------------------------------------------------


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


@pytest.fixture(scope="session")
def load_once():
    """`load(path, precision="auto")`: `load_model`, each path and precision loaded once per session.

    Weights are read-only once loaded, so every test may share them; a KV cache stays per test.
    """
    from corral.engine import load_model

    loaded = {}

    def load(path, precision: str = "auto"):
        key = (str(path), precision)
        if key not in loaded:
            loaded[key] = load_model(path, precision=precision)
        return loaded[key]

    return load


@pytest.fixture
def runtime_loads_once(monkeypatch, load_once):
    """`Runtime.open` runs as usual but takes its model from `load_once` (its cache is its own)."""
    import corral.runner.runtime as runtime_module

    monkeypatch.setattr(runtime_module, "load_model", lambda model, precision="auto", **_: load_once(model, precision))


def copy_store(root: pathlib.Path, to: pathlib.Path) -> pathlib.Path:
    """A private copy of the store at `root` (hard links: blobs are never written in place)."""
    shutil.copytree(root, to, copy_function=os.link)
    return to


@pytest.fixture(scope="session")
def seeded_store_root(tmp_path_factory, smollm2_path, gemma3_path) -> pathlib.Path:
    """A private model store holding the two real models (hard links into the default store)."""
    from corral import store

    return copy_store(store.default_store().root, tmp_path_factory.mktemp("store") / "models")


async def _serve(root: pathlib.Path, nursery) -> str:
    from corral.server.serve import serve
    from corral.store import Store

    address = await nursery.start(serve, "127.0.0.1", 0, Store(root))
    return f"http://{address}"


@pytest.fixture
async def server(seeded_store_root, tmp_path, nursery):
    """A live corral server on a free loopback port over a fresh copy of the seeded store; yields its URL."""
    yield await _serve(copy_store(seeded_store_root, tmp_path / "models"), nursery)
