"""Shared fixtures: paths to the real models and to the llama.cpp / transformers references.

Every test that needs a real model pulled into the store is marked `real_model`, so
`pytest -m "not real_model"` is a fast subset that runs offline with an empty store. Tests using
`smollm2_path` or `gemma3_path` (directly or through any fixture built on them: `seeded_store_root`,
`server`, ...) get the mark from `pytest_collection_modifyitems`; the few that reach a real model
another way carry it explicitly.
"""

import json
import os
import pathlib

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
def seeded_store_root(tmp_path_factory, smollm2_path, gemma3_path) -> pathlib.Path:
    """A private model store holding the two real models (hard links into the default store)."""
    import os
    import shutil

    from corral import store

    root = tmp_path_factory.mktemp("store") / "models"
    shutil.copytree(store.default_store().root, root, copy_function=os.link)
    return root


@pytest.fixture
async def server(seeded_store_root, tmp_path, nursery):
    """A live corral server on a free loopback port over a fresh copy of the seeded store; yields its URL."""
    import os
    import shutil

    from corral.server.serve import serve
    from corral.store import Store

    root = tmp_path / "models"
    shutil.copytree(seeded_store_root, root, copy_function=os.link)
    address = await nursery.start(serve, "127.0.0.1", 0, Store(root))
    yield f"http://{address}"
