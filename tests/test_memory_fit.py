"""Loading fits the model in the memory available: the context is lowered to fit, or the load is refused."""

import httpx
import pytest
from tiny_gguf import write_tiny_llama

from corral import memory
from corral.memory import Estimator, InsufficientMemoryError, MemoryEstimate, fit_context, memory_limit, plan_load
from corral.modelfile import ModelSpec, create_model
from corral.runner.runtime import Runtime
from corral.server.serve import serve
from corral.store import Store

MIB = 1 << 20


def linear(num_ctx: int) -> MemoryEstimate:
    """100 MiB of weights and 1 KiB of KV cache per context cell."""
    return MemoryEstimate(weights=100 * MIB, kv_cache=num_ctx * 1024, compute=0)


def test_a_context_that_fits_is_kept():
    assert fit_context(linear, 8192, 200 * MIB) == 8192
    assert fit_context(linear, 8192, None) == 8192  # nothing known about the machine: as asked


def test_the_context_is_lowered_to_the_largest_that_fits(caplog):
    fitted = fit_context(linear, 8192, 100 * MIB + 3000 * 1024 + 500, name="m")
    assert fitted == 3000
    assert "lowering the context to 3000" in caplog.text


def test_a_model_that_does_not_fit_even_a_small_context_is_refused():
    with pytest.raises(InsufficientMemoryError, match=r"needs 100 MiB .* only 99 MiB is available"):
        fit_context(linear, 8192, 99 * MIB)
    with pytest.raises(InsufficientMemoryError):  # the caller's floor: refuse rather than shrink
        fit_context(linear, 8192, 101 * MIB, floor=8192)


@pytest.mark.parametrize(("text", "size"), [("1000", 1000), ("2GiB", 2 << 30), ("512MB", 512 * 10**6), ("1.5 KiB", 1536)])
def test_memory_limit_sizes(text, size):
    assert memory_limit({"CORRAL_MEMORY_LIMIT": text}) == size


def test_the_memory_limit_caps_what_is_available(monkeypatch):
    monkeypatch.setenv("CORRAL_MEMORY_LIMIT", "3MiB")
    assert memory.available_bytes() == 3 * MIB
    monkeypatch.setenv("CORRAL_MEMORY_LIMIT", "lots")
    with pytest.raises(memory.CorralError, match="not a size"):
        memory.available_bytes()


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    """A tiny llama trained on 8192 positions: its KV cache, not its weights, decides what fits."""
    return write_tiny_llama(tmp_path_factory.mktemp("fit") / "long.gguf", context_length=8192)


def test_plan_load_fits_the_context_to_a_simulated_small_machine(long_context_model):
    estimate_at = Estimator(long_context_model, num_parallel=4)
    limit = estimate_at(1500).total + 100
    plan = plan_load(long_context_model, 8192, 4, available=limit)
    assert estimate_at(plan.num_ctx).total <= limit < estimate_at(plan.num_ctx + 1).total
    assert 1500 <= plan.num_ctx < 1600 and plan.estimate == estimate_at(plan.num_ctx)


async def test_a_runtime_loads_with_the_context_that_fits(long_context_model, monkeypatch):
    estimate_at = Estimator(long_context_model, num_parallel=2)
    monkeypatch.setenv("CORRAL_MEMORY_LIMIT", str(estimate_at(1024).total))
    async with Runtime.open(long_context_model, num_parallel=2, num_ctx=8192) as runtime:
        assert runtime.num_ctx == 1024
        assert runtime.status().memory_estimate == estimate_at(1024).total


async def test_a_model_too_big_for_the_machine_is_a_clear_error_over_http(long_context_model, nursery, tmp_path, monkeypatch):
    store = Store(tmp_path / "models")
    create_model(store, "long:latest", ModelSpec(gguf_path=long_context_model))
    weights = Estimator(long_context_model, num_parallel=1)(1).weights
    monkeypatch.setenv("CORRAL_MEMORY_LIMIT", str(weights // 2))
    address = await nursery.start(serve, "127.0.0.1", 0, store)
    async with httpx.AsyncClient(base_url=f"http://{address}", timeout=60) as http:
        reply = await http.post("/api/generate", json={"model": "long", "prompt": "Hi", "stream": False})
        assert reply.status_code == 503
        assert "only 0 MiB is available" in reply.json()["error"] and "/" not in reply.json()["error"].split("needs")[0][:-1]
        assert (await http.get("/api/ps")).json()["models"] == []


def test_on_cpu_the_system_memory_is_what_is_available(monkeypatch):
    from corral.registry import Plugins

    monkeypatch.delenv("CORRAL_MEMORY_LIMIT", raising=False)
    backend = Plugins().open_backend(device="cpu")
    assert backend.available_bytes() is None  # a GPU backend reports its free VRAM instead
    assert abs(memory.available_bytes(backend) - memory._mem_available()) < 64 * MIB  # MemAvailable, read twice
