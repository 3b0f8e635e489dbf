"""/health, /metrics, /api/tokenize, /api/detokenize and /openapi.json against a live server.

The server holds the tiny synthetic models (`client`) but where a test checks a real tokenizer's ids
(`real_client`).
"""

import types

import httpx
import pytest
import trio
import trio.testing
from conftest import TINY_LLAMA
from prometheus_client.parser import text_string_to_metric_families

from corral.runner.batching import BatchStats
from corral.runner.interface import RunnerStatus
from corral.runner.slots import SlotPool
from corral.scheduler import Scheduler
from corral.server.app import create_app
from corral.server.metrics import UNMATCHED, SchedulerCollector
from corral.server.openapi import UNDOCUMENTED, openapi_path, route_methods
from corral.store import Store

GAUGES = (
    "corral_models_loaded",
    "corral_queue_depth",
    "corral_running_sequences",
    "corral_batch_size",
    "corral_kv_cache_used_cells",
    "corral_kv_cache_cells",
)
METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


async def scrape(client: httpx.AsyncClient) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, keyed by name and sorted labels."""
    response = await client.get("/metrics")
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def requests_total(samples: dict, endpoint: str, status: int) -> float:
    return samples.get(("corral_requests_total", (("endpoint", endpoint), ("status", str(status)))), 0.0)


async def generate_three_tokens(client: httpx.AsyncClient) -> dict:
    response = await client.post(
        "/api/generate",
        json={"model": TINY_LLAMA, "prompt": "Why is the sky blue?", "stream": False,
              "options": {"num_predict": 3, "temperature": 0}},
    )
    assert response.status_code == 200
    return response.json()


@pytest.fixture
async def client(tiny_server):
    async with httpx.AsyncClient(base_url=tiny_server, timeout=120) as client:
        yield client


@pytest.fixture
async def real_client(server):
    async with httpx.AsyncClient(base_url=server, timeout=120) as client:
        yield client


@pytest.fixture
def app(tmp_path):
    """An app like the server's, for its url_map (its scheduler never runs)."""
    store = Store(tmp_path / "models")
    return create_app(Scheduler(store), store, None)


# --- /health -------------------------------------------------------------------------------
async def test_health_is_ok_with_no_model_loaded(client):
    response = await client.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "models_loaded": 0}


async def test_health_counts_loaded_models(client):
    await client.post("/api/generate", json={"model": TINY_LLAMA})  # an empty prompt only loads
    assert (await client.get("/health")).json()["models_loaded"] == 1


# --- /metrics ------------------------------------------------------------------------------
async def test_metrics_is_prometheus_text_with_every_family(client):
    response = await client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    names = {family.name for family in text_string_to_metric_families(response.text)}
    assert {"corral_requests", "corral_prompt_tokens", "corral_generated_tokens", *GAUGES} <= names


async def test_requests_total_counts_generate_by_route_and_status(client):
    before = await scrape(client)
    await generate_three_tokens(client)
    after = await scrape(client)
    assert requests_total(after, "/api/generate", 200) == requests_total(before, "/api/generate", 200) + 1


async def test_requests_total_counts_errors_with_their_status(client):
    await client.post("/api/show", json={"model": "no-such-model"})
    samples = await scrape(client)
    assert requests_total(samples, "/api/show", 404) == 1


async def test_requests_total_labels_unmatched_paths_alike(client):
    for path in ("/no/such/path", "/another/missing/one"):
        assert (await client.get(path)).status_code == 404
    samples = await scrape(client)
    assert requests_total(samples, UNMATCHED, 404) == 2
    assert not any("/no/such/path" in str(labels) for _, labels in samples)


async def test_token_counters_move_with_a_generation(client):
    before = await scrape(client)
    final = await generate_three_tokens(client)
    after = await scrape(client)
    generated = ("corral_generated_tokens_total", ())
    prompt = ("corral_prompt_tokens_total", ())
    assert after[generated] - before[generated] == 3
    assert after[prompt] - before[prompt] == final["prompt_eval_count"]


async def test_gauges_read_the_loaded_runtime(client):
    await generate_three_tokens(client)
    samples = await scrape(client)
    gauge = {name: value for (name, _), value in samples.items() if name in GAUGES}
    assert gauge["corral_models_loaded"] == 1
    assert gauge["corral_running_sequences"] == 0
    assert gauge["corral_queue_depth"] == 0
    assert gauge["corral_batch_size"] == 1  # the last step decoded one token
    # The finished sequence keeps its cells for prefix reuse.
    assert 0 < gauge["corral_kv_cache_used_cells"] < gauge["corral_kv_cache_cells"]


def test_scheduler_collector_sums_over_runtimes():
    def runtime(waiting, live, batch, used, cells):
        status = RunnerStatus(
            num_ctx=512, num_parallel=4, num_batch=64, live_sequences=live, waiting=waiting,
            cache_used_cells=used, cache_cells=cells, batch=BatchStats(last_batch_size=batch),
        )
        return types.SimpleNamespace(status=lambda: status)

    loaded = {
        "a": types.SimpleNamespace(runtime=runtime(2, 4, 7, 100, 1536)),
        "b": types.SimpleNamespace(runtime=runtime(1, 1, 3, 20, 2048)),
        "loading": types.SimpleNamespace(runtime=None),
    }
    families = SchedulerCollector(types.SimpleNamespace(loaded=loaded)).collect()
    values = {family.name: family.samples[0].value for family in families}
    assert values == {
        "corral_models_loaded": 3,
        "corral_queue_depth": 3,
        "corral_running_sequences": 5,
        "corral_batch_size": 10,
        "corral_kv_cache_used_cells": 120,
        "corral_kv_cache_cells": 3584,
    }


async def test_slot_pool_counts_waiting_requests():
    pool = SlotPool(1)
    await pool.acquire([1], lambda slot, tokens, prompt: 0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pool.acquire, [2], lambda slot, tokens, prompt: 0)
        await trio.testing.wait_all_tasks_blocked()
        assert pool.waiting == 1
        pool.release(0, [])
    assert pool.waiting == 0


def test_apps_in_one_process_keep_separate_registries(tmp_path):
    store = Store(tmp_path / "models")
    first, second = (create_app(Scheduler(store), store, None) for _ in range(2))
    first.extensions["corral"].metrics.record_request("/api/tags", 200)
    assert b'endpoint="/api/tags"' not in second.extensions["corral"].metrics.exposition()


# --- /api/tokenize, /api/detokenize --------------------------------------------------------
async def test_tokenize_and_detokenize_round_trip(real_client):
    tokens = (await real_client.post("/api/tokenize", json={"model": "smollm2", "content": "Hello world"})).json()
    assert tokens == {"tokens": [19556, 905]}
    text = (await real_client.post("/api/detokenize", json={"model": "smollm2", "tokens": tokens["tokens"]})).json()
    assert text == {"content": "Hello world"}


async def test_tokenize_reads_text_or_prompt_and_add_special(real_client):
    # gemma3 adds BOS (id 2) only when add_special is true.
    by_text = await real_client.post("/api/tokenize", json={"model": "gemma3:270m", "text": "Hello"})
    plain = await real_client.post("/api/tokenize", json={"model": "gemma3:270m", "prompt": "Hello", "add_special": False})
    assert by_text.json()["tokens"] == [2] + plain.json()["tokens"]


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/api/tokenize", {"model": "no-such-model", "content": "hi"}, 404),
        ("/api/detokenize", {"model": "no-such-model", "tokens": [1]}, 404),
        ("/api/tokenize", {"model": TINY_LLAMA, "content": 5}, 400),
        ("/api/tokenize", {"model": TINY_LLAMA, "content": "hi", "add_special": "yes"}, 400),
        ("/api/tokenize", {"model": TINY_LLAMA}, 400),
        ("/api/detokenize", {"model": TINY_LLAMA, "tokens": "200"}, 400),
        ("/api/detokenize", {"model": TINY_LLAMA, "tokens": [200, "201"]}, 400),
        ("/api/detokenize", {"model": TINY_LLAMA, "tokens": [10**9]}, 400),
    ],
)
async def test_tokenize_and_detokenize_reject_bad_requests(client, path, body, status):
    response = await client.post(path, json=body)
    assert response.status_code == status
    assert isinstance(response.json()["error"], str)


# --- /openapi.json -------------------------------------------------------------------------
@pytest.fixture
async def document(client):
    response = await client.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


async def test_openapi_lists_every_route_and_method(document, app):
    for rule in app.url_map.iter_rules():
        item = document["paths"].get(openapi_path(rule.rule))
        assert item is not None, f"{rule.rule} is missing"
        assert set(route_methods(rule)) <= set(item), f"{rule.rule} lacks {route_methods(rule)}"


async def test_openapi_writes_path_parameters_as_templates(document):
    assert not any("<" in path for path in document["paths"])


async def test_openapi_documents_every_route_by_hand(document):
    undocumented = [
        f"{method.upper()} {path}"
        for path, item in document["paths"].items()
        for method, op in item.items()
        if UNDOCUMENTED in op.get("tags", [])
    ]
    assert undocumented == [], "describe these in corral/server/openapi.py OPERATIONS"


async def test_openapi_document_is_valid(document):
    from openapi_spec_validator import validate

    assert document["openapi"].startswith("3.1")
    assert document["info"]["title"] and document["info"]["version"]
    for item in document["paths"].values():
        for method, op in item.items():
            if method in METHODS:
                assert op["responses"]
    validate(document)
