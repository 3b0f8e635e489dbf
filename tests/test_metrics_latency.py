"""/metrics' per-model latency histograms, token-count histograms, prefix-cache counters and runner restarts,
scraped before and after known requests on a live server over the tiny models. A runner that dies is counted
in tests/test_faults.py, which already kills one (runner processes are slow to start)."""

import json

import httpx
import pytest
from conftest import TINY_GEMMA3, TINY_LLAMA, _serve, copy_store
from prometheus_client.parser import text_string_to_metric_families


HISTOGRAMS = (
    "corral_time_to_first_token_seconds",
    "corral_inter_token_latency_seconds",
    "corral_e2e_request_latency_seconds",
    "corral_request_queue_time_seconds",
    "corral_request_prompt_tokens",
    "corral_request_generation_tokens",
)


async def scrape(http: httpx.AsyncClient) -> dict[tuple[str, tuple], float]:
    response = await http.get("/metrics")
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: dict, name: str, model: str, **labels) -> float:
    return samples.get((name, tuple(sorted({"model": model, **labels}.items()))), 0.0)


def moved(before: dict, after: dict, name: str, model: str, **labels) -> float:
    return value(after, name, model, **labels) - value(before, name, model, **labels)


async def generate(http: httpx.AsyncClient, model: str, prompt: str, tokens: int, stream: bool = False) -> dict:
    body = {"model": model, "prompt": prompt, "stream": stream, "options": {"num_predict": tokens, "temperature": 0, "ignore_eos": True}}
    if not stream:
        response = await http.post("/api/generate", json=body)
        assert response.status_code == 200, response.text
        return response.json()
    async with http.stream("POST", "/api/generate", json=body) as response:
        lines = [json.loads(line) async for line in response.aiter_lines() if line.strip()]
    return lines[-1]


@pytest.fixture
async def http(tiny_server):
    async with httpx.AsyncClient(base_url=tiny_server, timeout=120) as client:
        yield client


async def test_histograms_count_each_generation_once_per_model(http):
    before = await scrape(http)
    finals = [await generate(http, TINY_LLAMA, "Why is the sky blue?", 5), await generate(http, TINY_LLAMA, "And the sea?", 7, stream=True)]
    gemma = await generate(http, TINY_GEMMA3, "Hello", 3)
    after = await scrape(http)
    for name in HISTOGRAMS:
        if name != "corral_inter_token_latency_seconds":  # counted per gap between tokens
            assert moved(before, after, f"{name}_count", TINY_LLAMA) == 2, name
            assert moved(before, after, f"{name}_count", TINY_GEMMA3) == 1, name
    assert moved(before, after, "corral_inter_token_latency_seconds_count", TINY_LLAMA) == 4 + 6
    assert moved(before, after, "corral_inter_token_latency_seconds_count", TINY_GEMMA3) == 2
    assert moved(before, after, "corral_request_generation_tokens_sum", TINY_LLAMA) == 12
    assert moved(before, after, "corral_request_prompt_tokens_sum", TINY_LLAMA) == sum(f["prompt_eval_count"] for f in finals)
    assert moved(before, after, "corral_request_prompt_tokens_sum", TINY_GEMMA3) == gemma["prompt_eval_count"]


async def test_inter_token_latency_counts_every_gap_between_tokens(http):
    before = await scrape(http)
    await generate(http, TINY_LLAMA, "Count with me", 9, stream=True)
    after = await scrape(http)
    assert moved(before, after, "corral_inter_token_latency_seconds_count", TINY_LLAMA) == 8
    assert moved(before, after, "corral_time_to_first_token_seconds_count", TINY_LLAMA) == 1


async def test_latencies_are_ordered_as_one_request_lives(http):
    before = await scrape(http)
    final = await generate(http, TINY_LLAMA, "Order of events", 6)
    after = await scrape(http)
    ttft = moved(before, after, "corral_time_to_first_token_seconds_sum", TINY_LLAMA)
    e2e = moved(before, after, "corral_e2e_request_latency_seconds_sum", TINY_LLAMA)
    queue = moved(before, after, "corral_request_queue_time_seconds_sum", TINY_LLAMA)
    assert 0 <= queue <= ttft <= e2e <= final["total_duration"] / 1e9 + 0.05
    # The first request loads the model: its time to first token includes the load.
    assert ttft >= final["load_duration"] / 1e9 * 0.5


async def test_a_slow_bucket_holds_what_a_fast_one_misses(http):
    before = await scrape(http)
    await generate(http, TINY_LLAMA, "Buckets", 4)
    after = await scrape(http)
    # Cumulative buckets: +Inf holds the request; 1 ms cannot (a load and a prefill took longer).
    assert moved(before, after, "corral_e2e_request_latency_seconds_bucket", TINY_LLAMA, le="+Inf") == 1
    assert moved(before, after, "corral_time_to_first_token_seconds_bucket", TINY_LLAMA, le="0.001") == 0


async def test_prefix_cache_counts_reused_prompt_tokens(http):
    prompt = "The same long prompt, sent twice, so the second time its prefix comes from the cache."
    before = await scrape(http)
    first = await generate(http, TINY_LLAMA, prompt, 2)
    second = await generate(http, TINY_LLAMA, prompt, 2)
    after = await scrape(http)
    queries = moved(before, after, "corral_prefix_cache_queries_total", TINY_LLAMA)
    hits = moved(before, after, "corral_prefix_cache_hits_total", TINY_LLAMA)
    assert queries == first["prompt_eval_count"] + second["prompt_eval_count"]
    assert 0 < hits < second["prompt_eval_count"]  # the second request reused all but its last token
    assert value(after, "corral_prefix_cache_hit_rate", TINY_LLAMA) == pytest.approx(hits / queries)


async def test_unloading_a_model_is_no_restart(http):
    await generate(http, TINY_LLAMA, "Hi", 2)
    unload = await http.post("/api/generate", json={"model": TINY_LLAMA, "keep_alive": 0})
    assert unload.json()["done_reason"] == "unload"
    await generate(http, TINY_LLAMA, "Hi again", 2)
    assert value(await scrape(http), "corral_runner_restarts_total", TINY_LLAMA) == 0


async def test_histogram_families_are_described_before_any_traffic(tiny_store_root, tmp_path, nursery):
    url = await _serve(copy_store(tiny_store_root, tmp_path / "models"), nursery)
    async with httpx.AsyncClient(base_url=url) as http:
        text = (await http.get("/metrics")).text
    for name in (*HISTOGRAMS, "corral_prefix_cache_queries", "corral_prefix_cache_hits", "corral_runner_restarts"):
        assert f"# HELP {name} " in text or f"# HELP {name}_total " in text, name
