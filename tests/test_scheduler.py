"""The scheduler on a live server: queue limits, keep-alive, eviction, reloads, memory-aware sizes."""


import httpx
import pytest
import trio
from conftest import copy_store

from corral import memory
from corral.model import bound_layers
from corral.scheduler import parse_keep_alive
from corral.server.serve import serve
from corral.store import Store


async def start_server(nursery, seeded_store_root, tmp_path, monkeypatch, **env):
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    address = await nursery.start(serve, "127.0.0.1", 0, Store(copy_store(seeded_store_root, tmp_path / "models")))
    return f"http://{address}"


async def loaded_models(http) -> list[str]:
    return [m["name"] for m in (await http.get("/api/ps")).json()["models"]]


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, None), ("", None), (0, 0.0), ("0", 0.0), (30, 30.0), ("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25), (-1, float("inf")), ("-1m", float("inf"))],
)
def test_keep_alive_parsing(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", True, [1], "m5"])
def test_keep_alive_rejects_nonsense(value):
    from corral.scheduler import InvalidKeepAliveError

    with pytest.raises(InvalidKeepAliveError):
        parse_keep_alive(value)


async def queue_depth(http) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families((await http.get("/metrics")).text):
        if family.name == "corral_queue_depth":
            return sum(sample.value for sample in family.samples)
    return 0.0


async def test_queue_overflow_answers_503_at_once(nursery, seeded_store_root, tmp_path, monkeypatch):
    url = await start_server(nursery, seeded_store_root, tmp_path, monkeypatch, CORRAL_MAX_QUEUE=1, CORRAL_NUM_PARALLEL=1)
    # A raw counting prompt, greedy, keeps going (sampled, it may end early); streamed, it holds the
    # one slot however fast the model is, until the client hangs up.
    endless = {"model": "smollm2", "prompt": "1, 2, 3, 4, 5,", "raw": True, "options": {"num_predict": 3000, "temperature": 0}}
    short = {"model": "smollm2", "prompt": "1, 2, 3,", "raw": True, "stream": False, "options": {"num_predict": 4}}
    statuses = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        await http.post("/api/generate", json={"model": "smollm2", "prompt": ""})  # loaded before the rush

        async def post():
            statuses.append((await http.post("/api/generate", json=short)).status_code)

        async with trio.open_nursery() as requests:
            async with http.stream("POST", "/api/generate", json=endless) as first:
                lines = first.aiter_lines()  # kept: a dropped iterator would close the stream
                await lines.__anext__()  # generating: it has the slot
                requests.start_soon(post)  # waits for it
                with trio.fail_after(60):
                    while await queue_depth(http) < 1:
                        await trio.sleep(0.05)
                busy = await http.post("/api/generate", json=short)  # one too many: answered at once
                assert busy.status_code == 503 and "server busy" in busy.json()["error"]
            # leaving the stream hangs up: the slot goes to the waiting request
    assert statuses == [200]


async def test_max_loaded_models_evicts_the_idle_model(nursery, seeded_store_root, tmp_path, monkeypatch):
    url = await start_server(nursery, seeded_store_root, tmp_path, monkeypatch, CORRAL_MAX_LOADED_MODELS=1)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        await http.post("/api/generate", json={"model": "smollm2", "prompt": "Hi", "stream": False, "options": {"num_predict": 2}})
        assert await loaded_models(http) == ["smollm2:latest"]
        await http.post("/api/generate", json={"model": "gemma3:270m", "prompt": "Hi", "stream": False, "options": {"num_predict": 2}})
        assert await loaded_models(http) == ["gemma3:270m"]


async def test_changing_a_load_time_option_reloads(nursery, seeded_store_root, tmp_path, monkeypatch):
    url = await start_server(nursery, seeded_store_root, tmp_path, monkeypatch)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        body = {"model": "smollm2", "prompt": "Hi", "stream": False, "options": {"num_predict": 1, "num_ctx": 512}}
        await http.post("/api/generate", json=body)
        first = (await http.get("/api/ps")).json()["models"][0]["context_length"]
        body["options"]["num_ctx"] = 1024
        await http.post("/api/generate", json=body)
        second = (await http.get("/api/ps")).json()["models"][0]["context_length"]
    assert (first, second) == (512, 1024)


async def test_keep_alive_expires_after_the_last_request(nursery, seeded_store_root, tmp_path, monkeypatch):
    url = await start_server(nursery, seeded_store_root, tmp_path, monkeypatch)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        body = {"model": "smollm2", "prompt": "Hi", "stream": False, "keep_alive": "1s", "options": {"num_predict": 1}}
        await http.post("/api/generate", json=body)
        assert await loaded_models(http) == ["smollm2:latest"]
        await trio.sleep(1.5)
        assert await loaded_models(http) == []


async def test_ps_reports_the_predicted_size(nursery, seeded_store_root, tmp_path, monkeypatch, smollm2_path):
    url = await start_server(nursery, seeded_store_root, tmp_path, monkeypatch, CORRAL_NUM_PARALLEL=2)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        await http.post("/api/generate", json={"model": "smollm2", "prompt": "", "options": {"num_ctx": 2048}})
        entry = (await http.get("/api/ps")).json()["models"][0]
    predicted = memory.estimate(smollm2_path, 2048, 2).total
    assert entry["size"] == predicted and entry["context_length"] == 2048


def test_memory_estimate_grows_with_context_and_parallelism(smollm2_path):
    small = memory.estimate(smollm2_path, 1024, 1)
    large = memory.estimate(smollm2_path, 4096, 4)
    assert small.weights == large.weights
    # 30 layers x 3 kv heads x (64 + 64) dims x 2 bytes per cell
    assert small.kv_cache == 30 * 3 * 128 * 2 * 1024
    assert large.kv_cache == 16 * small.kv_cache


def test_memory_estimate_of_the_weights_matches_what_the_backend_loads(smollm2_path):
    from corral.engine import load_model

    model = load_model(smollm2_path)
    loaded = sum(model.backend.weight_bytes(layer.weight) for layer in bound_layers(model.model))
    assert memory.estimate(smollm2_path, 1024, 1).weights == pytest.approx(loaded, rel=0.02)
