"""Every OLLAMA_* setting the README promises is read and takes effect (CORRAL_* unset, as an Ollama user has it).

OLLAMA_HOST is proven by tests/test_serve_lifecycle.py (a real `corral serve` bound through it);
OLLAMA_ORIGINS belongs to the origin checks; OLLAMA_KV_CACHE_TYPE to tests/test_kv_cache_fallback.py (over HTTP).
"""

import httpx
import pytest
import trio
from conftest import TINY_GEMMA3, TINY_LLAMA, copy_store

from corral.scheduler import Scheduler, ServerBusyError
from corral.server.serve import serve
from corral.store import Store, default_store

SETTINGS = ("NUM_PARALLEL", "MAX_LOADED_MODELS", "MAX_QUEUE", "MODELS", "KEEP_ALIVE", "CONTEXT_LENGTH", "HOST")


@pytest.fixture
def ollama_env(monkeypatch):
    """Set OLLAMA_<name> with no CORRAL_* equivalent in the way."""
    for name in SETTINGS:
        monkeypatch.delenv(f"CORRAL_{name}", raising=False)
        monkeypatch.delenv(f"OLLAMA_{name}", raising=False)

    def set_env(**values):
        for name, value in values.items():
            monkeypatch.setenv(f"OLLAMA_{name}", str(value))

    return set_env


@pytest.fixture
def tiny_store(tiny_store_root, tmp_path):
    return Store(copy_store(tiny_store_root, tmp_path / "models"))


@pytest.fixture
async def scheduler(nursery, tiny_store, ollama_env):
    async def start(**values):
        ollama_env(**values)
        return await nursery.start(Scheduler(tiny_store).run)

    return start


async def test_ollama_num_parallel_sets_the_sequence_slots(scheduler):
    started = await scheduler(NUM_PARALLEL=3)
    async with started.use(TINY_LLAMA) as entry:
        assert entry.runtime.status().num_parallel == 3


async def test_ollama_context_length_sets_the_default_context(scheduler):
    started = await scheduler(CONTEXT_LENGTH=64)
    async with started.use(TINY_LLAMA) as entry:
        assert entry.runtime.num_ctx == 64


async def test_ollama_max_loaded_models_unloads_the_idle_model(scheduler):
    started = await scheduler(MAX_LOADED_MODELS=1)
    async with started.use(TINY_LLAMA):
        pass
    async with started.use(TINY_GEMMA3):
        assert list(started.loaded) == [TINY_GEMMA3]


async def test_ollama_max_queue_refuses_requests_beyond_it(scheduler):
    started = await scheduler(MAX_QUEUE=0)
    with pytest.raises(ServerBusyError):
        async with started.use(TINY_LLAMA):
            pass


async def test_ollama_keep_alive_sets_how_long_a_model_stays(scheduler):
    started = await scheduler(KEEP_ALIVE="0")
    async with started.use(TINY_LLAMA):
        assert list(started.loaded) == [TINY_LLAMA]
    with trio.fail_after(10):
        while started.loaded:
            await trio.sleep(0.01)


async def test_ollama_models_is_the_store(nursery, tiny_store, ollama_env):
    ollama_env(MODELS=tiny_store.root)
    assert default_store().root == tiny_store.root
    address = await nursery.start(serve, "127.0.0.1", 0)
    async with httpx.AsyncClient(base_url=f"http://{address}") as http:
        names = {model["name"] for model in (await http.get("/api/tags")).json()["models"]}
    assert names == {TINY_LLAMA, TINY_GEMMA3}
