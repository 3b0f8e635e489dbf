"""The Trio runtime end to end on the real models: batching, cancellation, stop strings, UTF-8, context
limits, prefix reuse, logprobs, chat and errors.

Every test opens its own runtime inside its own Trio run; a model is loaded once per session (see
`runtime_loads_once` in conftest.py), so opening a runtime costs only its KV cache.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import trio

import corral.runner.batching as batching_module
from corral.kvcache import CausalCache, shift_sequence
from corral.model import Batch
from corral.options import InvalidOptionError
from corral.runner.batching import EVENT_BUFFER, Finished, Sampled, Sequence
from corral.runner.runtime import InvalidPromptError, Runtime
from corral.runner.sequence import SequenceActor, truncate_prompt
from corral.tokenizer import IncrementalDecoder

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("runtime_loads_once")]


@pytest.fixture
def model_path(request, smollm2_path, gemma3_path):
    """The path of the model named by the test's `name` parameter."""
    return {"smollm2": smollm2_path, "gemma3": gemma3_path}[request.node.callspec.params["name"]]


async def complete(rt: Runtime, prompt: str, options: dict, **kwargs):
    """The whole text and the final chunk of one request."""
    async with rt.generate(prompt, options, **kwargs) as stream:
        return await stream.collect()


async def chunks_of(rt: Runtime, prompt: str, options: dict, **kwargs) -> list:
    async with rt.generate(prompt, options, **kwargs) as stream:
        return [chunk async for chunk in stream]


def generated_ids(chunks) -> list[int]:
    return [token for chunk in chunks for token in chunk.token_ids]


STORY = "Once upon a time, in a small village by the sea, there lived"
COUNTING = "1, 2, 3, 4, 5,"

# -- batch invariance ------------------------------------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at",
    COUNTING,
    "The three primary colors are",
    "In 1969, the first humans to walk on the Moon were",
    "A haiku about autumn leaves:\n",
    # longer than num_batch: its prompt is fed in chunks, alone and among the others
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light energy "
    "into chemical energy. During this process, carbon dioxide and water are combined, using the energy "
    "of sunlight captured by chlorophyll, to produce glucose and release oxygen. The glucose is then",
]
NUM_BATCH = 32
BATCH_PREDICT = {"smollm2": 24, "gemma3": 12}  # gemma3's 262k vocabulary makes each step slower on CPU


async def alone_and_together(path, options: list[dict]) -> tuple[list[str], list[str], int, int]:
    """Each prompt's text run alone, then all at once in a fresh runtime; and the steps each took.

    Each prompt runs alone in a runtime of its own: in a shared one, a prompt would reuse the cells
    of its predecessor's prefix (the BOS token) and so be cut into other chunks than when batched,
    which is prefix reuse, not batching (see core/runner/batching.py)."""
    alone, alone_steps = [], 0
    for prompt, opts in zip(PROMPTS, options):
        async with Runtime.open(path, num_parallel=1, num_ctx=256, num_batch=NUM_BATCH) as rt:
            alone.append((await complete(rt, prompt, opts, raw=True))[0])
            alone_steps += rt.batcher.stats.steps
    together = [""] * len(PROMPTS)
    async with Runtime.open(path, num_parallel=len(PROMPTS), num_ctx=256, num_batch=NUM_BATCH) as rt:

        async def run(i):
            together[i] = (await complete(rt, PROMPTS[i], options[i], raw=True))[0]

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(run, i)
        together_steps = rt.batcher.stats.steps
    return alone, together, alone_steps, together_steps


async def test_requests_that_arrive_together_share_their_first_step(smollm2_path, monkeypatch):
    # A long wait bound: the first step must start because every request was added, not on time.
    monkeypatch.setattr(batching_module, "ARRIVAL_WAIT", 30.0)
    async with Runtime.open(smollm2_path, num_parallel=4, num_ctx=256) as rt:
        finals = [None] * 4

        async def run(i):
            finals[i] = (await complete(rt, PROMPTS[i % len(PROMPTS)], {"temperature": 0, "num_predict": 1}, raw=True))[1]

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(run, i)
        assert all(final.eval_count == 1 for final in finals)
        assert rt.batcher.stats.steps == 1 and rt.batcher.arriving == 0


async def test_a_request_failing_before_its_sequence_starts_is_not_waited_for(smollm2_path, monkeypatch):
    monkeypatch.setattr(batching_module, "ARRIVAL_WAIT", 30.0)
    async with Runtime.open(smollm2_path, num_parallel=2, num_ctx=256) as rt:
        with pytest.raises(InvalidPromptError):
            await complete(rt, "", {"num_predict": 1}, raw=True)  # an empty prompt fails after tokenizing
        assert rt.batcher.arriving == 0
        with trio.fail_after(20):
            text, final = await complete(rt, STORY, {"temperature": 0, "num_predict": 2}, raw=True)
        assert final.eval_count == 2


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
async def test_greedy_output_is_the_same_alone_and_batched(name, model_path):
    options = [{"temperature": 0, "num_predict": BATCH_PREDICT[name]}] * len(PROMPTS)
    alone, together, alone_steps, together_steps = await alone_and_together(model_path, options)
    assert together_steps < alone_steps / 3, "the concurrent requests should have shared steps"
    assert all(alone), "every prompt should produce text"
    assert together == alone


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
async def test_seeded_sampling_is_the_same_alone_and_batched(name, model_path):
    options = [{"temperature": 0.8, "seed": 1000 + i, "num_predict": BATCH_PREDICT[name]} for i in range(len(PROMPTS))]
    alone, together, alone_steps, together_steps = await alone_and_together(model_path, options)
    assert together_steps < alone_steps / 3
    assert together == alone


# -- cancellation ----------------------------------------------------------------------------------


def stage(rt: Runtime, prompt: list[int]) -> str:
    """How far the runtime has got with the sequence of this prompt."""
    for seq in rt.batcher.sequences:
        if seq.prompt == prompt:
            return "decoding" if seq.generated else "prefilling" if seq.cached else "scheduled"
    return "not started"


async def test_cancelled_requests_leave_no_sequence_cell_slot_or_task_behind(smollm2_path):
    num_parallel, requests = 4, 200
    options = {"temperature": 0, "num_predict": 1000}  # counting never ends on its own before the cancel
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=256) as rt:
        expected, _ = await complete(rt, STORY, {"temperature": 0, "num_predict": 16}, raw=True)

    rng = random.Random(7)
    # wait: cancelled within 50 ms, mostly while waiting for a slot; anytime: within 0.5 s, wherever
    # that falls; prefill: once the first chunk of its prompt is computed; decode: after k chunks
    modes = ["wait"] * 10 + ["anytime"] * 4 + ["prefill"] * 3 + ["decode"] * 3
    plans = [(rng.uniform(0, 2), rng.choice(modes), rng.random(), rng.randint(1, 2)) for _ in range(requests)]
    stage_reached = [False] * requests
    async with Runtime.open(smollm2_path, num_parallel=num_parallel, num_ctx=256, num_batch=16) as rt:

        async def request(i):
            delay, how, fraction, k = plans[i]
            await trio.sleep(delay)
            # a prefill takes two chunks of 16 tokens; the other prompts fit in one
            prompt = f"{i}: " + ", ".join(str(n) for n in range(1, 10 if how == "prefill" else 5)) + ","
            ids = rt.model.tokenize(prompt)
            with trio.move_on_after({"wait": 0.05 * fraction, "anytime": 0.5 * fraction}.get(how, 60)):
                async with rt.generate(prompt, options, raw=True) as stream:
                    if how == "prefill":
                        while stage(rt, ids) not in ("prefilling", "decoding"):
                            await trio.sleep(0.001)
                        stage_reached[i] = stage(rt, ids) == "prefilling"
                        return
                    async for chunk in stream:
                        assert not chunk.done
                        k -= 1
                        if how == "decode" and k == 0:
                            stage_reached[i] = True
                            break

        async with trio.open_nursery() as nursery:
            for i in range(requests):
                nursery.start_soon(request, i)

        assert requests - rt.stats.requests > 10, "some requests should be cancelled before they got a slot"
        # Some of each kind must be cancelled where they aim (~30 plans each): how many get there depends
        # on how often the polling task runs, which other jobs on the cores change.
        assert sum(stage_reached[i] for i, plan in enumerate(plans) if plan[1] == "prefill") > 2
        assert sum(stage_reached[i] for i, plan in enumerate(plans) if plan[1] == "decode") > 2

        with trio.fail_after(5):  # a cancelled sequence task ends at its next checkpoint
            while len(rt._nursery.child_tasks) > 1:
                await trio.sleep(0.01)
        [task] = rt._nursery.child_tasks
        assert task.name.endswith("BatchingActor.run")
        assert rt.status().live_sequences == 0
        assert rt.cache.used_cells() == 0
        assert rt.slots.free == num_parallel

        text, final = await complete(rt, STORY, {"temperature": 0, "num_predict": 16}, raw=True)
        assert final.done_reason == "length" and text == expected


# -- stop strings ----------------------------------------------------------------------------------


def spanning_stop(pieces: list[str], full: str) -> str:
    """Two consecutive generated tokens' text whose first occurrence in `full` is where they were generated."""
    for i in range(len(pieces) // 2, len(pieces) - 1):
        stop = pieces[i] + pieces[i + 1]
        if pieces[i].strip() and pieces[i + 1].strip() and full.find(stop) == len("".join(pieces[:i])):
            return stop
    raise AssertionError(f"no two-token stop text in {full!r}")


async def test_stop_string_spanning_tokens_ends_generation_before_it(smollm2_path):
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=256) as rt:
        unstopped = await chunks_of(rt, STORY, {"temperature": 0, "num_predict": 40}, raw=True)
        full = "".join(chunk.text for chunk in unstopped)
        pieces = [rt.model.detokenize([t]) for t in generated_ids(unstopped)]
        stop = spanning_stop(pieces, full)

        stopped = await chunks_of(rt, STORY, {"temperature": 0, "num_predict": 40, "stop": ["zebra", stop]}, raw=True)
    text = "".join(chunk.text for chunk in stopped)
    assert stopped[-1].done and stopped[-1].done_reason == "stop"
    assert text == full[: full.index(stop)]
    assert stopped[-1].eval_count < unstopped[-1].eval_count


async def test_generation_without_a_stop_string_match_is_unchanged(smollm2_path):
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=256) as rt:
        plain, plain_final = await complete(rt, STORY, {"temperature": 0, "num_predict": 20}, raw=True)
        word = max(plain.split(), key=len)  # held back as the possible start of the stop, then released
        held, held_final = await complete(rt, STORY, {"temperature": 0, "num_predict": 20, "stop": [word + "qqzx"]}, raw=True)
    assert held == plain
    assert held_final.done_reason == plain_final.done_reason == "length"


# -- UTF-8 -----------------------------------------------------------------------------------------

# The greedy continuation repeats the line; each count ends the generation at a line end.
UTF8_PROMPT = "🦙 日本語\n" * 4
UTF8_PREDICT = {"smollm2": 22, "gemma3": 21}  # two lines of 11 tokens; three lines of 7


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
async def test_streamed_emoji_and_cjk_are_never_split(name, model_path):
    async with Runtime.open(model_path, num_parallel=1, num_ctx=256) as rt:
        chunks = await chunks_of(rt, UTF8_PROMPT, {"temperature": 0, "num_predict": UTF8_PREDICT[name]}, raw=True)
        whole = await rt.detokenize(generated_ids(chunks))
    text = "".join(chunk.text for chunk in chunks)
    assert "🦙 日本語" in text
    for chunk in chunks:
        assert "\ufffd" not in chunk.text
        assert not any(0xD800 <= ord(c) <= 0xDFFF for c in chunk.text)
    assert text == whole
    assert any(len(chunk.token_ids) > 1 for chunk in chunks), "some character should span tokens"


def test_incremental_decoder_holds_byte_tokens_until_the_character_is_complete(gemma3_path, load_once):
    tokenizer = load_once(gemma3_path).tokenizer
    ids = tokenizer.encode("🦙 日本語", add_special=False)
    assert [len(tokenizer.token_bytes(t)) for t in ids[:4]] == [1, 1, 1, 1], "gemma3 spells 🦙 in byte tokens"
    decoder = IncrementalDecoder(tokenizer)
    assert [decoder.feed(t) for t in ids] == ["", "", "", "🦙", " 日本", "語"]
    assert decoder.flush() == ""


async def test_sequence_actor_sends_a_byte_split_character_with_all_its_tokens(gemma3_path, load_once):
    tokenizer = load_once(gemma3_path).tokenizer
    ids = tokenizer.encode("🦙 日本語", add_special=False)
    events_send, events = trio.open_memory_channel(EVENT_BUFFER + 2)
    seq = Sequence(id=0, prompt=[2], pending=[], position=1, sampler=None, events=events_send)
    actor = SequenceActor(seq, tokenizer, (), 0, True, resume=lambda: None)
    for token in ids:
        events_send.send_nowait(Sampled(token, -0.5, ((token, -0.5),)))
    events_send.send_nowait(Finished("length"))
    out_send, out = trio.open_memory_channel(len(ids) + 1)
    async with events:
        await actor.run(events, out_send)
    chunks = [out.receive_nowait() for _ in range(4)]
    assert [(c.text, c.token_ids) for c in chunks[:3]] == [("🦙", tuple(ids[:4])), (" 日本", (ids[4],)), ("語", (ids[5],))]
    assert [lp.token for lp in chunks[0].logprobs] == ids[:4]
    assert chunks[3].done and chunks[3].done_reason == "length" and chunks[3].eval_count == len(ids)
    assert chunks[3].context == (2, *ids)


# -- num_predict and the context -------------------------------------------------------------------


async def test_num_predict_generates_exactly_that_many_tokens(smollm2_path):
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=256) as rt:
        chunks = await chunks_of(rt, COUNTING, {"temperature": 0, "num_predict": 7}, raw=True)
    final = chunks[-1]
    assert len(generated_ids(chunks)) == 7 == final.eval_count
    assert final.done_reason == "length"
    assert len(final.context) == final.prompt_eval_count + 7


async def test_generation_shifts_the_context_and_continues_past_num_ctx(smollm2_path):
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=64) as rt:
        chunks = await chunks_of(rt, STORY, {"temperature": 0, "num_predict": 100}, raw=True)
        positions = rt.cache.positions(0)
    final, text = chunks[-1], "".join(c.text for c in chunks)
    assert final.done_reason == "length" and final.eval_count == 100
    shifts = rt.batcher.stats.shifts
    assert shifts > 0
    # each shift keeps num_keep (4) tokens and drops half of the other 60
    assert positions.tolist() == list(range(final.prompt_eval_count + 99 - 30 * shifts))
    assert "\ufffd" not in text
    assert sum(c.isalpha() or c.isspace() or c in ".,'!?\"" for c in text) / len(text) > 0.95, text


async def test_generation_without_shift_ends_at_num_ctx(smollm2_path):
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=64) as rt:
        _, final = await complete(rt, STORY, {"temperature": 0, "num_predict": 100}, raw=True, shift=False)
        assert rt.batcher.stats.shifts == 0
    assert final.done_reason == "length"
    # the cache holds 64 tokens; the token sampled from the last of them is the final one
    assert final.eval_count == 64 - final.prompt_eval_count + 1


async def test_num_predict_minus_two_fills_the_context_then_stops(smollm2_path):
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=64) as rt:
        _, final = await complete(rt, STORY, {"temperature": 0, "num_predict": -2}, raw=True)
        assert rt.batcher.stats.shifts == 0
    assert final.done_reason == "length"
    assert final.eval_count == 64 - final.prompt_eval_count + 1


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_context_shift_equals_translating_the_kept_tokens(name, model_path, load_once):
    """After a shift, the next logits equal those of the unshifted cache with the kept head moved right.

    Attention under RoPE depends only on distances, so dropping [keep, keep + discard) and moving
    the tail left by `discard` (the shift) must equal keeping the tail's cells as they were and
    recomputing the head `discard` positions later, with the query at its unshifted position. (It
    does not equal a fresh forward over the kept tokens: the tail's keys were computed while the
    dropped tokens were still in context, as in llama.cpp.)
    """
    model = load_once(model_path, "fp32")
    ids = model.tokenize(STORY + " a wise and kind woman named Elara. She was a skilled healer and had many friends.")
    n, keep, discard = 30, 4, 12
    following = ids[n : n + 3]
    assert len(following) == 3

    def filled() -> CausalCache:
        cache = CausalCache(model.backend, model.model.cache_layers(), 64)
        model.forward(Batch.single(ids[:n]), cache)
        return cache

    shifted = filled()
    shifted.remove(0, keep, keep + discard)
    shift_sequence(model.model, shifted, 0, keep + discard, -discard)
    assert shifted.positions(0).tolist() == list(range(n - discard))
    got = model.forward(Batch.single(following, start=n - discard, all_logits=True), shifted)

    translated = filled()
    translated.remove(0, 0, keep + discard)
    model.forward(Batch.single(ids[:keep], start=discard), translated)
    expected = model.forward(Batch.single(following, start=n, all_logits=True), translated)

    unrotated = filled()  # positions moved but keys not re-rotated: what the test must tell apart
    unrotated.remove(0, keep, keep + discard)
    unrotated.shift_positions(0, keep + discard, -discard)
    wrong = model.forward(Batch.single(following, start=n - discard, all_logits=True), unrotated)

    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * scale)
    assert np.abs(wrong - expected).max() > 1e-2 * scale


# -- prompt truncation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "num_ctx", "num_keep", "expected"),
    [
        pytest.param(10, 10, 4, list(range(10)), id="fits"),
        pytest.param(20, 10, 4, [0, 1, 2, 3, *range(14, 20)], id="keeps-head-drops-middle"),
        pytest.param(20, 10, 0, list(range(10, 20)), id="no-keep-keeps-the-end"),
        pytest.param(20, 10, 15, [*range(9), 19], id="keep-capped-below-num_ctx"),
        pytest.param(20, 10, -1, [*range(9), 19], id="keep-all-means-the-whole-prompt-as-far-as-it-fits"),
    ],
)
def test_truncate_prompt(length, num_ctx, num_keep, expected):
    assert truncate_prompt(list(range(length)), num_ctx, num_keep) == expected


async def test_prompt_longer_than_num_ctx_is_truncated_not_refused(smollm2_path):
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=64) as rt:
        ids = await rt.tokenize(" ".join(f"word{i}" for i in range(60)))
        assert len(ids) > 64
        _, final = await complete(rt, "", {"temperature": 0, "num_predict": 4}, raw=True, context=ids)
    assert final.done_reason == "length" and final.eval_count == 4
    assert final.prompt_eval_count <= 64
    prompt = list(final.context[: final.prompt_eval_count])
    assert prompt == ids[:4] + ids[len(ids) - (final.prompt_eval_count - 4) :]


async def test_chat_history_too_long_drops_the_oldest_turns_but_keeps_system_and_last(smollm2_path):
    filler = " ".join(["The weather report said it would rain all week in the mountains."] * 4)
    system = {"role": "system", "content": "You are a terse assistant."}
    history = [
        {"role": "user", "content": "First question. " + filler},
        {"role": "assistant", "content": "First answer. " + filler},
        {"role": "user", "content": "Second question. " + filler},
        {"role": "assistant", "content": "Second answer, short."},
    ]
    last = {"role": "user", "content": "What is 2 + 2?"}
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=512) as rt:
        expected = rt.model.chat_ids([system, history[-1], last])
        num_ctx = len(expected) + 8
        assert len(rt.model.chat_ids([system, *history[-2:], last])) > num_ctx
        async with rt.chat([system, *history, last], {"temperature": 0, "num_predict": 4, "num_ctx": num_ctx}) as stream:
            _, final = await stream.collect()
    assert list(final.context[: final.prompt_eval_count]) == expected


# -- prefix reuse ----------------------------------------------------------------------------------

SHARED = (
    "The history of the bicycle begins in the early nineteenth century, when inventors across Europe "
    "experimented with two-wheeled machines pushed along by the rider's feet. "
)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
async def test_prefix_reuse_gives_the_output_of_a_fresh_computation(name, model_path):
    options = {"temperature": 0, "num_predict": 12}
    second = SHARED + "Later designs added pedals, and"
    async with Runtime.open(model_path, num_parallel=2, num_ctx=256) as rt:
        await complete(rt, SHARED + "The first of them was called", options, raw=True)
        hits = rt.stats.cache_hits
        reused_text, reused = await complete(rt, second, options, raw=True)
        assert rt.stats.cache_hits == hits + 1
        assert rt.stats.prompt_tokens_reused >= reused.prompt_cached_count
    assert reused.prompt_cached_count > 20
    async with Runtime.open(model_path, num_parallel=1, num_ctx=256) as fresh:
        fresh_text, fresh_final = await complete(fresh, second, options, raw=True)
    assert fresh_final.prompt_cached_count == 0
    assert reused_text == fresh_text


async def test_continuing_past_the_sliding_window_reuses_the_context(gemma3_path):
    """gemma3's sliding-window layers forgot the oldest cells, yet the window before the new tokens is intact."""
    options = {"temperature": 0, "num_predict": 6}
    long_prompt = " ".join(SHARED for _ in range(17))
    async with Runtime.open(gemma3_path, num_parallel=1, num_ctx=1024) as rt:
        _, first = await complete(rt, long_prompt, options, raw=True)
        window = rt.model.model.config.sliding_window
        assert len(first.context) > window + 20
        assert not rt.cache.has_window_cells(0, 1), "the window layers should have forgotten the start"
        text, final = await complete(rt, " In conclusion,", options, raw=True, context=list(first.context))
    assert final.prompt_cached_count == len(first.context) - 1
    async with Runtime.open(gemma3_path, num_parallel=1, num_ctx=1024) as fresh:
        fresh_text, _ = await complete(fresh, " In conclusion,", options, raw=True, context=list(first.context))
    assert text == fresh_text


async def test_a_prefix_the_sliding_window_forgot_is_computed_again(gemma3_path):
    long_prompt = " ".join(SHARED for _ in range(17))
    async with Runtime.open(gemma3_path, num_parallel=1, num_ctx=1024) as rt:
        _, first = await complete(rt, long_prompt, {"temperature": 0, "num_predict": 1}, raw=True)
        head = list(first.context[:300])  # its window-layer keys are gone; only the global layers kept them
        _, final = await complete(rt, " Finally,", {"temperature": 0, "num_predict": 1}, raw=True, context=head)
    assert final.prompt_cached_count == 0
    assert rt.stats.cache_hits == 0


async def test_reader_leaving_at_the_final_chunk_keeps_the_prefix_for_reuse(smollm2_path):
    options = {"temperature": 0, "num_predict": 4}
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=256) as rt:
        for _ in range(8):  # the reader's exit and the sequence's own end race: try both orders
            async with rt.generate(SHARED, options, raw=True) as stream:
                async for chunk in stream:
                    if chunk.done:
                        break
            assert rt.cache.used_cells() > 0
        _, final = await complete(rt, SHARED + "Later designs added pedals.", options, raw=True)
    assert final.prompt_cached_count > 20


# -- logprobs --------------------------------------------------------------------------------------


async def test_logprobs_of_greedy_tokens_are_the_top_alternative(smollm2_path):
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=256) as rt:
        chunks = await chunks_of(rt, STORY, {"temperature": 0, "num_predict": 8}, raw=True, logprobs=True, top_logprobs=5)
        entries = [(chunk, lp) for chunk in chunks for lp in chunk.logprobs]
        assert [lp.token for _, lp in entries] == generated_ids(chunks)
        for chunk, lp in entries:
            assert lp.logprob <= 0
            assert len(lp.top) == 5
            values = [value for _, _, value in lp.top]
            assert values == sorted(values, reverse=True)
            assert lp.top[0][0] == lp.token
            assert lp.top[0][2] == pytest.approx(lp.logprob, abs=1e-5)
            assert lp.text == await rt.detokenize([lp.token])
            assert all(text == rt.model.detokenize([token]) for token, text, _ in lp.top)
    assert len(entries) == 8


async def test_no_logprobs_unless_asked(smollm2_path):
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=256) as rt:
        chunks = await chunks_of(rt, STORY, {"temperature": 0, "num_predict": 3}, raw=True)
    assert generated_ids(chunks) and all(chunk.logprobs == () for chunk in chunks)


# -- chat ------------------------------------------------------------------------------------------


async def test_chat_answers_the_capital_of_france(smollm2_path):
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=256) as rt:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        async with rt.chat(messages, {"temperature": 0, "num_predict": 24}) as stream:
            chunks = [chunk async for chunk in stream]
    assert "Paris" in "".join(chunk.text for chunk in chunks)
    assert len(chunks) > 2 and chunks[-1].done_reason == "stop"


async def test_ignore_eos_generates_past_the_end_of_the_answer(smollm2_path):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=256) as rt:
        async with rt.chat(messages, {"temperature": 0, "num_predict": 40}) as stream:
            _, stopped = await stream.collect()
        async with rt.chat(messages, {"temperature": 0, "num_predict": 40, "ignore_eos": True}) as stream:
            _, kept_on = await stream.collect()
    assert stopped.done_reason == "stop" and stopped.eval_count < 40
    assert kept_on.done_reason == "length" and kept_on.eval_count == 40


# -- errors ----------------------------------------------------------------------------------------


async def test_invalid_option_raises_before_any_work(smollm2_path):
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=256) as rt:
        with pytest.raises(InvalidOptionError, match="temperature"):
            async with rt.generate("hi", {"temperature": "hot"}):
                pass
        with pytest.raises(InvalidOptionError, match="top_logprobs"):
            async with rt.generate("hi", {"temperature": 0}, logprobs=True, top_logprobs=50):
                pass
        assert rt.stats.requests == 0 and rt.status().live_sequences == 0


async def test_error_in_a_sequence_reaches_its_reader_and_the_runtime_keeps_serving(smollm2_path):
    async with Runtime.open(smollm2_path, num_parallel=1, num_ctx=256) as rt:
        with pytest.raises(InvalidPromptError, match="empty"):
            await complete(rt, "", {"temperature": 0}, raw=True)
        with pytest.raises(InvalidPromptError, match="vocabulary"):
            await complete(rt, "hi", {"temperature": 0, "num_predict": 2}, raw=True, context=[10**9])
        text, final = await complete(rt, "The capital of France is", {"temperature": 0, "num_predict": 3}, raw=True)
        assert "Paris" in text and final.done_reason == "length"
        assert rt.slots.free == 1
