"""Shared fixtures: the real models (and stores and servers over them), a store of tiny synthetic
models (and a server over it), and the llama.cpp / transformers references (llama.cpp's sources, and
tiny transformers models converted with its converter: reference_models.py).

Every test that needs a real model pulled into the store is marked `real_model`, one that needs
llama.cpp's sources `peers`, and one that takes seconds (processes, servers, a browser, transformers
models) `slow`, so `pytest -m "not real_model and not peers and not slow"` is a fast subset that runs
offline with an empty store (README). Tests using
`smollm2_path` or `gemma3_path` (directly or through any fixture built on them: `seeded_store_root`,
`server`, ...) get the mark from `pytest_collection_modifyitems`; the few that reach a real model
another way carry it explicitly.
"""

import json
import os
import pathlib
import re
import shutil
import sys

import filelock
import numpy as np
import pytest

# Server tests run models in-process (fast, and test-registered plugins apply); the runner-process
# tests and the fault tests ask for CORRAL_RUNNER=process themselves.
os.environ.setdefault("CORRAL_RUNNER", "inprocess")
# OpenMP workers sleep between parallel regions instead of spinning (set before torch loads OpenMP;
# runner processes inherit it): on cores that other jobs share, a spinning thread burns its time slice
# waiting for a descheduled one, and tests of small tensors run many times slower. Set
# OMP_WAIT_POLICY=active to measure the other way.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REFERENCE = pathlib.Path(__file__).resolve().parent / "reference"

# Fixtures that pull a real model into the store; everything that needs a real model depends on one.
# all-MiniLM (test_embed_minilm.py) is a real model too: its wheel comes from PyPI.
REAL_MODEL_FIXTURES = frozenset({"smollm2_path", "gemma3_path", "sentence_transformer", "minilm_folder", "minilm_path", "minilm_f16_path"})
# Fixtures that need llama.cpp's sources (downloaded from PyPI once, then cached; see peers.py).
PEER_FIXTURES = frozenset({"llama_cpp_dir"})
# Fixtures that take seconds to build (a model made by transformers): their tests are left out of the fast subset.
SLOW_FIXTURES = frozenset({"tiny_folder"})


# A module's own marks: `pytestmark = pytest.mark.X` (or a list of marks) on one line at its top level.
_MODULE_MARKS = re.compile(r"^pytestmark\s*=\s*(.+)$", re.MULTILINE)


def pytest_ignore_collect(collection_path, config):
    """Leave uncollected a test module whose own marks the -m expression excludes ("not X" in its
    top-level `and`s): importing one costs seconds (ray, a browser driver, torch in a subprocess) that
    deselecting its tests afterwards would not give back. Any other expression collects everything."""
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    expression = config.option.markexpr
    if not expression or " or " in expression or "(" in expression:
        return None
    excluded = {term.strip()[4:].strip() for term in expression.split(" and ") if term.strip().startswith("not ")}
    if not excluded:
        return None
    declared = _MODULE_MARKS.search(collection_path.read_text(encoding="utf-8"))
    if declared and excluded & set(re.findall(r"pytest\.mark\.(\w+)", declared.group(1))):
        return True
    return None


def pytest_collection_modifyitems(items):
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if REAL_MODEL_FIXTURES.intersection(fixtures):
            item.add_marker(pytest.mark.real_model)
        if PEER_FIXTURES.intersection(fixtures):
            item.add_marker(pytest.mark.peers)
        if SLOW_FIXTURES.intersection(fixtures):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def llama_cpp_dir() -> pathlib.Path:
    """llama.cpp's source tree (converter, vocab suite, templates), fetched once into CORRAL_PEERS."""
    import peers

    return peers.llama_cpp_sources()


@pytest.fixture(scope="session")
def converted_references(request, llama_cpp_dir, tmp_path_factory):
    """The tiny transformers models (reference_models.SPECS) this session's tests use, each built and
    converted with llama.cpp's converter once, by one driver process, into a temporary folder.

    Under pytest-xdist every worker collects the whole session, so all of them ask for the same specs:
    the first converts them into the folder the workers share, the others wait for it and read it."""
    from reference_models import SPECS, ReferenceSpec, ConvertedReferences, convert

    used = {
        value.name
        for item in request.session.items
        for value in getattr(getattr(item, "callspec", None), "params", {}).values()
        if isinstance(value, ReferenceSpec)
    }
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "references"
    with filelock.FileLock(f"{root}.lock"):
        done = root / "converted.json"
        if not done.is_file():
            root.mkdir(exist_ok=True)
            convert(llama_cpp_dir, root, [s for s in SPECS if s.name in used])
            done.write_text(json.dumps(sorted(used)))
    return ConvertedReferences(root)


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """torch's thread count as it was before the test (the setting is process-wide: a runtime's
    num_thread would otherwise carry into whichever tests its worker runs next)."""
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None and before is not None and torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture
def torch_threads(request):
    """torch's compute threads set to the test's parameter (indirect) for the test."""
    import torch

    torch.set_num_threads(request.param)
    return request.param


@pytest.fixture(autouse=True)
def unmarked_tests_see_an_empty_store(request, monkeypatch):
    """A test not marked real_model gets an empty default store (its own fixtures may still set one), so
    a test that reaches a real model without the mark fails on every machine, not only on a fresh one."""
    if request.node.get_closest_marker("real_model") is None:
        monkeypatch.setenv("CORRAL_MODELS", str(request.getfixturevalue("tmp_path") / "empty-store"))


# --- the real models -------------------------------------------------------------------------------


def _real_model(name: str) -> pathlib.Path:
    """The model in the default store, pulled on first use (by one pytest-xdist worker; the others wait)."""
    import peers

    from corral import store

    with peers.cache_lock(f"pull-{name.replace(':', '-')}"):
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

    Weights are read-only once loaded, so every test may share them; a KV cache stays per test. (A
    template change would have to go through `with_template`, which leaves the shared model as it is.)
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


# --- tiny synthetic models -------------------------------------------------------------------------

TINY_LLAMA = "tiny-llama:latest"
TINY_GEMMA3 = "tiny-gemma3:latest"
# A ChatML template, as smollm2's, so a tiny model chats and `show` has a template to report.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_store_root(tmp_path_factory) -> pathlib.Path:
    """A model store of tiny random models, created as `corral create` would: a llama with a ChatML
    template and a gemma3 without one. No real model is needed and any test may load them in a blink."""
    from tiny_gguf import write_tiny_gemma3, write_tiny_llama

    from corral.modelfile import ModelSpec, create_model
    from corral.store import Store

    files = tmp_path_factory.mktemp("tiny-gguf")
    store = Store(tmp_path_factory.mktemp("tiny-store") / "models")
    create_model(store, TINY_LLAMA, ModelSpec(gguf_path=write_tiny_llama(files / "llama.gguf"), template=CHATML))
    create_model(store, TINY_GEMMA3, ModelSpec(gguf_path=write_tiny_gemma3(files / "gemma3.gguf")))
    return store.root


@pytest.fixture
async def tiny_server(tiny_store_root, tmp_path, nursery):
    """A live corral server like `server`, over a fresh copy of the tiny store; yields its URL."""
    yield await _serve(copy_store(tiny_store_root, tmp_path / "models"), nursery)


# --- plugins ---------------------------------------------------------------------------------------


@pytest.fixture
def no_allow_list_from_the_environment(monkeypatch):
    """CORRAL_LOAD_PLUGINS unset, so a developer's allow-list does not change what loads."""
    from corral.registry import ALLOW_ENV

    monkeypatch.delenv(ALLOW_ENV, raising=False)


# LangChain's clients, imported by the tests that use them (not at collection: importing them takes seconds).
@pytest.fixture(scope="session")
def langchain_openai():
    return pytest.importorskip("langchain_openai")


@pytest.fixture(scope="session")
def langchain_ollama():
    return pytest.importorskip("langchain_ollama")
