"""The server-wide KV cache type (CORRAL_KV_CACHE_TYPE / OLLAMA_KV_CACHE_TYPE) is a preference, as Ollama
treats it: a model whose head dims are off the 32-value block loads with f16 and one warning naming it, and
a name the server does not know is logged and ignored. A `kv_cache_type` a request or a Modelfile asks for
and the model cannot take stays a 400 (tests/test_kv_cache_types.py has the request's)."""

from __future__ import annotations

import logging

import httpx
import pytest
from conftest import TINY_LLAMA, _serve, copy_store
from tiny_gguf import write_tiny_gemma3, write_tiny_llama

from corral import memory
from corral.engine import load_model
from corral.kvcache import UnsupportedKVCacheTypeError
from corral.modelfile import ModelSpec, create_model
from corral.plugins.backends.torch.kv_cells import QuantizedCells
from corral.runner.process import RunnerProcess
from corral.runner.runtime import Runtime
from corral.scheduler import Scheduler, kv_cache_type_from_env
from corral.store import Store

GREEDY = {"temperature": 0, "num_predict": 3}


def fallback_warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if "loading it with f16" in record.getMessage()]


@pytest.fixture
def keys_fit_values_do_not(tmp_path) -> str:
    """A gemma3 whose keys have 32 values a head (one block) and whose values have 24."""
    return write_tiny_gemma3(tmp_path / "gemma3-v24.gguf", key_length=32, value_length=24)


async def test_the_servers_type_becomes_f16_with_one_warning_for_a_model_that_cannot_take_it(keys_fit_values_do_not, caplog):
    with caplog.at_level(logging.WARNING, logger="corral"):
        async with Runtime.open(
            keys_fit_values_do_not, num_parallel=1, num_ctx=64, kv_cache_type="q8_0", kv_cache_fallback=True, name="tiny-v24:latest"
        ) as rt:
            assert rt.cache.cache_type == "f16" and not isinstance(rt.cache.values[0], QuantizedCells)
            # the memory plan was made for the cache that was built, not for the q8_0 one it replaced
            assert rt.status().memory_estimate == memory.estimate(keys_fit_values_do_not, 64, 1, kv_cache_type="f16").total
            async with rt.generate("hello", GREEDY, raw=True) as stream:
                _, final = await stream.collect()
            assert final.eval_count == 3
    [warning] = fallback_warnings(caplog)
    assert warning.startswith("tiny-v24:latest: the KV cache type q8_0 cannot hold")
    assert "multiple of 32; this model's is 24" in warning


async def test_a_loaded_model_passed_in_falls_back_too(keys_fit_values_do_not, caplog):
    loaded = load_model(keys_fit_values_do_not)
    try:
        with caplog.at_level(logging.WARNING, logger="corral"):
            async with Runtime.open(loaded, num_parallel=1, num_ctx=64, kv_cache_type="q4_0", kv_cache_fallback=True) as rt:
                assert rt.cache.cache_type == "f16"
        [warning] = fallback_warnings(caplog)
        assert warning.startswith(f"{loaded.info.name}: the KV cache type q4_0")
        with pytest.raises(UnsupportedKVCacheTypeError):
            async with Runtime.open(loaded, num_parallel=1, num_ctx=64, kv_cache_type="q4_0"):
                pass
    finally:
        loaded.close()


async def test_the_servers_type_is_kept_for_a_model_that_can_take_it(tmp_path, caplog):
    path = write_tiny_llama(tmp_path / "llama-32.gguf", head_count=2, head_count_kv=1)  # heads of 32 values
    with caplog.at_level(logging.WARNING, logger="corral"):
        async with Runtime.open(path, num_parallel=1, num_ctx=64, kv_cache_type="q4_0", kv_cache_fallback=True) as rt:
            assert rt.cache.cache_type == "q4_0" and isinstance(rt.cache.keys[0], QuantizedCells)
    assert fallback_warnings(caplog) == []


async def test_an_asked_type_the_model_cannot_take_is_refused(keys_fit_values_do_not):
    with pytest.raises(UnsupportedKVCacheTypeError, match="kv_cache_type q4_0: a q4_0 KV cache needs head dims .* is 24; use f16"):
        async with Runtime.open(keys_fit_values_do_not, num_parallel=1, num_ctx=64, kv_cache_type="q4_0"):
            pass


def test_the_environment_is_read_as_ollama_reads_it(monkeypatch, caplog):
    monkeypatch.delenv("CORRAL_KV_CACHE_TYPE", raising=False)
    monkeypatch.setenv("OLLAMA_KV_CACHE_TYPE", "Q8_0")  # Ollama lowercases it
    assert kv_cache_type_from_env() == "q8_0"
    monkeypatch.setenv("CORRAL_KV_CACHE_TYPE", "q5_1")  # a type it does not know: logged, and f16
    with caplog.at_level(logging.WARNING, logger="corral.scheduler"):
        assert kv_cache_type_from_env() == "f16"
    assert [record.getMessage() for record in caplog.records] == [
        "CORRAL_KV_CACHE_TYPE must be one of f16, q8_0, q4_0, got 'q5_1'; using f16"
    ]


@pytest.fixture
async def q8_0_server(monkeypatch, tiny_store_root, tmp_path, nursery):
    """A live server over the tiny store (its llama has heads of 16 values) with OLLAMA_KV_CACHE_TYPE=q8_0."""
    monkeypatch.delenv("CORRAL_KV_CACHE_TYPE", raising=False)
    monkeypatch.setenv("OLLAMA_KV_CACHE_TYPE", "q8_0")
    yield await _serve(copy_store(tiny_store_root, tmp_path / "models"), nursery)


async def test_over_http_the_servers_type_falls_back_and_an_asked_one_is_a_400(q8_0_server, caplog):
    async with httpx.AsyncClient(base_url=q8_0_server, timeout=120) as client:
        with caplog.at_level(logging.WARNING, logger="corral"):
            served = await client.post("/api/generate", json={"model": "tiny-llama", "prompt": "hi", "stream": False, "options": GREEDY})
        assert served.status_code == 200 and served.json()["eval_count"] == 3
        [warning] = fallback_warnings(caplog)
        assert warning.startswith(f"{TINY_LLAMA}: the KV cache type q8_0") and "this model's is 16" in warning

        asked = await client.post(
            "/api/generate", json={"model": "tiny-llama", "prompt": "hi", "stream": False, "options": {**GREEDY, "kv_cache_type": "q8_0"}}
        )
        assert asked.status_code == 400 and "use f16" in asked.json()["error"]

        created = await client.post(
            "/api/create", json={"model": "tiny-q8", "from": "tiny-llama", "parameters": {"kv_cache_type": "q8_0"}, "stream": False}
        )
        assert created.status_code == 200
        from_modelfile = await client.post("/api/generate", json={"model": "tiny-q8", "prompt": "hi", "stream": False, "options": GREEDY})
        assert from_modelfile.status_code == 400 and "kv_cache_type q8_0" in from_modelfile.json()["error"]


@pytest.mark.slow
async def test_a_runner_process_falls_back_and_names_the_model(keys_fit_values_do_not, caplog):
    with caplog.at_level(logging.WARNING, logger="corral"):
        async with RunnerProcess.open(
            keys_fit_values_do_not, num_parallel=1, num_ctx=64, kv_cache_type="q8_0", kv_cache_fallback=True, name="tiny-v24:latest"
        ) as runner:
            async with runner.generate("hello", GREEDY, raw=True) as stream:
                _, final = await stream.collect()
            assert final.eval_count == 3
    [warning] = fallback_warnings(caplog)
    assert "tiny-v24:latest: the KV cache type q8_0 cannot hold" in warning and "is 24" in warning


async def test_a_load_the_scheduler_retries_warns_once(tmp_path, monkeypatch, nursery, caplog):
    """With an idle model loaded the scheduler first asks for the whole context, then unloads the idle one and lets
    the context be lowered: two tries, one load, one warning."""
    store = Store(tmp_path / "models")
    create_model(store, "idle:latest", ModelSpec(gguf_path=write_tiny_llama(tmp_path / "idle.gguf", head_count=2, head_count_kv=1)))  # takes q8_0
    v24 = write_tiny_gemma3(tmp_path / "v24.gguf", key_length=32, value_length=24, context_length=8192)
    create_model(store, "v24:latest", ModelSpec(gguf_path=v24))
    monkeypatch.setenv("CORRAL_MEMORY_LIMIT", str(memory.estimate(v24, 1024, 1, kv_cache_type="f16").total))
    scheduler = Scheduler(store, num_parallel=1, default_num_ctx=8192, runner="inprocess", kv_cache_type="q8_0")
    await nursery.start(scheduler.run)
    async with scheduler.use("idle"):
        pass
    with caplog.at_level(logging.INFO, logger="corral"):
        async with scheduler.use("v24") as loaded:
            assert loaded.runtime.num_ctx == 1024 and loaded.runtime.cache.cache_type == "f16"
    assert list(scheduler.loaded) == ["v24:latest"]
    assert "unloading idle:latest: v24:latest does not fit in memory beside it" in caplog.text  # it was retried
    [warning] = fallback_warnings(caplog)
    assert warning.startswith("v24:latest: the KV cache type q8_0 cannot hold")
