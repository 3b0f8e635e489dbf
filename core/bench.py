"""`corral bench`: load time, prefill and decode throughput at batch 1, memory."""

from __future__ import annotations

import resource
import time

import numpy as np

from corral.engine import load_model
from corral.model import Batch

BENCH_TEXT = (
    "The history of astronomy spans thousands of years, from the first people who tracked the moon "
    "and planets to the telescopes that map galaxies billions of light years away. "
)


def current_rss_mb() -> float:
    """Resident memory of this process now, in MB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 1e6


def peak_rss_mb() -> float:
    """Peak resident memory of this process, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


def prompt_ids(model, count: int) -> list[int]:
    """`count` token ids of ordinary English text."""
    ids: list[int] = []
    while len(ids) < count:
        ids += model.tokenize(BENCH_TEXT, add_special=False)
    return ids[:count]


def greedy_decode_s(model, logits, cache, position: int, count: int) -> float:
    """Seconds to decode `count` greedy tokens at batch 1 after `logits` (the last row's), from `position` on."""
    token = int(np.argmax(logits[-1]))
    start = time.perf_counter()
    for _ in range(count):
        logits = model.forward(Batch.single([token], start=position), cache)
        token, position = int(np.argmax(logits[-1])), position + 1
    return time.perf_counter() - start


def run_bench(name: str, prompt_tokens: int = 512, gen_tokens: int = 128, precision: str = "auto", from_empty: bool = False) -> dict:
    """Load `name`, prefill `prompt_tokens` in one batch, decode `gen_tokens` greedily; return the figures.

    With `from_empty`, also `decode_tok_s_from_empty`: the same decode after a one-token prompt (llama-bench's
    `tg` test decodes from an empty context; the main figure decodes after the prompt)."""
    start = time.perf_counter()
    model = load_model(name, precision=precision)
    load_s = time.perf_counter() - start
    rss_after_load = current_rss_mb()

    ids = prompt_ids(model, prompt_tokens)
    # Warm up as llama-bench does before it measures (its warm-up runs the test's whole prompt): the
    # first prompt of a size pays one-time costs (page faults on new buffers, kernels' first calls)
    # that no later request pays; 15-25% of a 512-token prefill here (BENCHMARKS.md, issue 19).
    model.forward(Batch.single(ids), model.new_cache(prompt_tokens))

    cache = model.new_cache(prompt_tokens + gen_tokens)
    start = time.perf_counter()
    logits = model.forward(Batch.single(ids), cache)
    prefill_s = time.perf_counter() - start

    decode_s = greedy_decode_s(model, logits, cache, prompt_tokens, gen_tokens)
    extra = {}
    if from_empty:
        cache = model.new_cache(1 + gen_tokens)
        extra["decode_tok_s_from_empty"] = gen_tokens / greedy_decode_s(model, model.forward(Batch.single(ids[:1]), cache), cache, 1, gen_tokens)

    return {
        "model": name,
        "architecture": model.info.architecture,
        "quantization": model.info.quantization,
        "precision": precision,
        "load_s": load_s,
        "prefill_tokens": prompt_tokens,
        "prefill_tok_s": prompt_tokens / prefill_s,
        "decode_tokens": gen_tokens,
        "decode_tok_s": gen_tokens / decode_s,
        "rss_after_load_mb": rss_after_load,
        "peak_rss_mb": peak_rss_mb(),
        **extra,
    }


def run_concurrency_bench(name: str, concurrency: int, prompt_tokens: int = 128, gen_tokens: int = 128, precision: str = "auto") -> dict:
    """`concurrency` parallel greedy streams through the Trio runtime: aggregate tokens/s and latency."""
    import statistics

    import trio

    from corral.runner.runtime import Runtime

    async def main() -> dict:
        async with Runtime.open(name, num_parallel=concurrency, num_ctx=prompt_tokens + gen_tokens + 8, precision=precision) as rt:
            base = prompt_ids(rt.model, prompt_tokens)
            latencies, counts = [], []

            async def one(i: int) -> None:
                # A distinct first token per stream, so no stream reuses another's prefix.
                text = rt.model.detokenize([base[(i * 7) % len(base)]] + base[1:])
                start = time.perf_counter()
                # Every stream generates gen_tokens, as llama.cpp's side of benchmarks/side_by_side.py does.
                options = {"temperature": 0, "num_predict": gen_tokens, "ignore_eos": True}
                async with rt.generate(text, options=options, raw=True) as stream:
                    _, final = await stream.collect()
                latencies.append(time.perf_counter() - start)
                counts.append(final.eval_count)

            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(concurrency):
                    nursery.start_soon(one, i)
            wall = time.perf_counter() - start
            return {
                "model": name,
                "concurrency": concurrency,
                "generated_tokens": sum(counts),
                "aggregate_tok_s": sum(counts) / wall,
                "median_latency_s": statistics.median(latencies),
                "peak_rss_mb": peak_rss_mb(),
            }

    return trio.run(main)


FORMAT_PROMPT = "List ten planets of science fiction as a JSON object with their names, sizes and a long description of each."


def run_format_bench(
    name: str, format: str | dict = "json", batches: tuple[int, ...] = (1, 8), gen_tokens: int = 128, rounds: int = 3,
    precision: str = "auto",
) -> dict:
    """Decode tokens/s with and without a `format` (constrained decoding), at each batch size, through the runtime.

    Rounds alternate the two conditions (and their order), so a shared machine's drift hits both alike; the
    figures are each condition's median over the rounds. A stream's decode rate is its eval_count over its
    eval_duration; a batch's is the sum over its streams. Every stream samples with Ollama's default options
    (seeded), so the grammar's fast path sees real draws; unconstrained streams ignore end-of-generation."""
    import statistics

    import trio

    from corral.runner.runtime import Runtime

    async def one_batch(rt: Runtime, batch: int, constrained: bool) -> float:
        rates: list[float] = []

        async def stream(i: int) -> None:
            options = {"num_predict": gen_tokens, "seed": i, "ignore_eos": not constrained}
            async with rt.generate(FORMAT_PROMPT, options=options, format=format if constrained else None) as chunks:
                _, final = await chunks.collect()
            if final.eval_duration > 0:
                rates.append(final.eval_count / (final.eval_duration / 1e9))

        async with trio.open_nursery() as nursery:
            for i in range(batch):
                nursery.start_soon(stream, i)
        return sum(rates)

    async def main() -> dict:
        figures: dict = {"model": name, "format": format, "gen_tokens": gen_tokens, "rounds": rounds}
        async with Runtime.open(name, num_parallel=max(batches), num_ctx=512 + gen_tokens, precision=precision) as rt:
            await one_batch(rt, 1, True)  # warm up: the llguidance tokenizer, kernels
            for batch in batches:
                free, constrained = [], []
                for round_ in range(rounds):
                    for is_constrained in (False, True) if round_ % 2 == 0 else (True, False):
                        (constrained if is_constrained else free).append(await one_batch(rt, batch, is_constrained))
                figures[f"batch_{batch}"] = {
                    "unconstrained_tok_s": statistics.median(free),
                    "constrained_tok_s": statistics.median(constrained),
                    "ratio": statistics.median(constrained) / statistics.median(free),
                }
        return figures

    return trio.run(main)
