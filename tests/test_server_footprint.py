"""The server routes and its runner processes compute: `corral serve` never imports torch and stays small."""

import json
import subprocess
import sys

import httpx
import pytest
from conftest import TINY_LLAMA, copy_store
from serve_process import ServeProcess, children_of, maps_torch, resident_mib

pytestmark = pytest.mark.slow  # server and runner processes: out of the fast subset (-m "not slow")

SERVER_RSS_LIMIT_MIB = 80


def test_the_server_process_never_imports_torch_and_stays_under_80_mb(tiny_store_root, tmp_path):
    with ServeProcess(tiny_store_root) as served:
        body = {"model": TINY_LLAMA, "prompt": "Hi", "stream": False, "format": "json", "options": {"num_predict": 3}}
        reply = httpx.post(served.url + "/api/generate", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        httpx.post(served.url + "/v1/chat/completions", timeout=120, json={
            "model": TINY_LLAMA, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
        }).raise_for_status()
        httpx.get(served.url + "/metrics", timeout=30).raise_for_status()
        runners = children_of(served.pid)
        assert runners and any(maps_torch(pid) for pid in runners)  # the model is computed, elsewhere
        assert not maps_torch(served.pid)
        assert resident_mib(served.pid) < SERVER_RSS_LIMIT_MIB


def test_the_server_starts_without_the_native_libraries_only_runners_and_creates_need():
    """tokenizers and llguidance (~8 MB of the server's RSS) load with the first create or constrained request, not at start."""
    probe = "import sys, corral.server.serve, corral.server.app; print(sorted({'torch', 'tokenizers', 'llguidance'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


TINY_BERT = "tiny-bert:latest"
# The server as `corral serve` runs it (it execs `python -m corral.server`), writing the names in its
# sys.modules to a file when it exits.
SERVE_AND_LIST_MODULES = (
    "import atexit, json, os, runpy, sys\n"
    "atexit.register(lambda: open(os.environ['MODULES_FILE'], 'w').write(json.dumps(sorted(sys.modules))))\n"
    "runpy.run_module('corral.server', run_name='__main__', alter_sys=True)\n"
)


@pytest.fixture
def store_with_an_embedding_model(tiny_store_root, tmp_path):
    """A copy of the tiny store with a tiny nomic-bert (mean pooling) beside its llama, to embed with."""
    from test_embed_architectures import write_tiny_nomic_bert

    from corral.modelfile import ModelSpec, create_model
    from corral.store import Store

    store = Store(copy_store(tiny_store_root, tmp_path / "models"))
    write_tiny_nomic_bert(tmp_path / "nomic-bert.gguf")
    create_model(store, TINY_BERT, ModelSpec(gguf_path=tmp_path / "nomic-bert.gguf"))
    return store.root


def test_the_routing_server_serves_loads_and_streams_without_numpy_gguf_or_sentencepiece(store_with_an_embedding_model, tmp_path):
    """numpy, gguf and the sentencepiece it imports are ~22 MB of the server's RSS: it reads GGUF headers with
    struct and leaves tensors, and the libraries, to its runners (BENCHMARKS.md "Server RSS holding 500 open streams")."""
    modules_file = tmp_path / "modules.json"
    chat = [{"role": "user", "content": "Hi"}]
    requests = [
        ("get", "/api/tags", None),
        ("post", "/api/show", {"model": TINY_LLAMA}),
        ("post", "/api/generate", {"model": TINY_LLAMA, "prompt": "Hi", "options": {"num_predict": 3}}),  # loads it, streams
        ("post", "/api/chat", {"model": TINY_LLAMA, "messages": chat, "options": {"num_predict": 3}}),
        ("post", "/api/tokenize", {"model": TINY_LLAMA, "content": "Hi"}),
        ("get", "/api/ps", None),
        ("post", "/v1/chat/completions", {"model": TINY_LLAMA, "max_tokens": 3, "stream": True, "messages": chat}),
        ("post", "/v1/completions", {"model": TINY_LLAMA, "max_tokens": 3, "prompt": "Hi"}),
        ("get", "/v1/models", None),
        ("post", "/api/embed", {"model": TINY_BERT, "input": ["Hi", "there"]}),
        ("post", "/api/embeddings", {"model": TINY_BERT, "prompt": "Hi"}),
        ("post", "/v1/embeddings", {"model": TINY_BERT, "input": "Hi", "encoding_format": "base64"}),
        ("post", "/api/create", {"model": "terse", "from": TINY_LLAMA, "system": "Be terse.", "stream": False}),
        ("post", "/api/show", {"model": "terse"}),
        ("get", "/metrics", None),
    ]
    served = ServeProcess(store_with_an_embedding_model, env={"MODULES_FILE": str(modules_file)}, python_args=("-c", SERVE_AND_LIST_MODULES))
    with served:
        for method, path, body in requests:
            reply = httpx.request(method, served.url + path, json=body, timeout=120)
            assert reply.status_code == 200, (path, reply.text)
        assert len(httpx.get(served.url + "/api/ps", timeout=30).json()["models"]) == 2  # both models were loaded, in runners
        too_long = httpx.post(served.url + "/api/embed", json={"model": TINY_BERT, "input": "Hi " * 100, "truncate": False}, timeout=60)
        assert too_long.status_code == 400 and "longer than the context" in too_long.json()["error"]  # the runner's error, typed
        assert served.terminate() == 0, served.output
    imported = {name.split(".")[0] for name in json.loads(modules_file.read_text())}
    assert "corral" in imported and "quart" in imported
    assert imported & {"numpy", "gguf", "sentencepiece", "torch"} == set()


def errors_known_after(imports: str) -> set[str]:
    """The corral errors a process that imported `imports` rebuilds from their name and a message (runner/wire.py)."""
    probe = (
        f"import {imports}\n"
        "from corral.runner.wire import _corral_errors, error_from_json\n"
        "for name in _corral_errors():\n"
        "    print(name, type(error_from_json({'type': name, 'message': 'm'})).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return {name for name, rebuilt in (line.split() for line in done.stdout.splitlines()) if rebuilt == name}


def test_every_error_a_runner_raises_keeps_its_type_and_status_in_the_routing_server():
    """A runner process's error reaches the server by name and becomes the same class, so the same HTTP status
    (an InputTooLongError a 400, not a 500), only if the server has imported it: such errors live in corral.errors,
    not in the runner's modules (numpy, torch, tokenizers) that raise them."""
    in_runners = errors_known_after("corral.runner.__main__")
    assert {"InputTooLongError", "InvalidPromptError", "CacheFullError", "ProjectorError"} <= in_runners
    assert in_runners - errors_known_after("corral.server.serve, corral.server.app") == set()
