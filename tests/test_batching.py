"""The batching actor's pure parts, with no model: which tokens each step takes and the batch they make."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from corral.runner.batching import EVENT_BUFFER, Sequence, build_batch, plan_step


def make_seq(id, pending, position=0, generated=0, buffered=0, finished=False) -> Sequence:
    """A Sequence as the batching actor sees it; `buffered` events wait unread in its channel."""
    send, _ = trio.open_memory_channel(EVENT_BUFFER + 2)
    for _ in range(buffered):
        send.send_nowait(None)
    seq = Sequence(id=id, prompt=list(pending), pending=list(pending), position=position, sampler=None, events=send)
    seq.generated, seq.finished = generated, finished
    return seq


def prefill(id, n, position=0):
    return make_seq(id, list(range(100 + id * 10, 100 + id * 10 + n)), position)


def decode(id, position=20, **kw):
    return make_seq(id, [7 + id], position, generated=3, **kw)


@pytest.mark.parametrize(
    ("sequences", "budget", "expected"),
    [
        pytest.param([prefill(0, 10), decode(1), decode(2)], 512, [(1, 1), (2, 1), (0, 10)], id="decodes-before-prefill"),
        pytest.param([prefill(0, 10), prefill(1, 10)], 15, [(0, 10)], id="a-chunk-that-does-not-fit-waits"),
        pytest.param([prefill(0, 4), prefill(1, 3)], 16, [(0, 4), (1, 3)], id="small-prompts-share-a-step"),
        pytest.param([prefill(0, 40), prefill(1, 3)], 16, [(0, 16)], id="long-prompt-takes-the-budget-in-order"),
        pytest.param([decode(0), decode(1), decode(2), prefill(3, 4)], 2, [(0, 1), (1, 1), (2, 1), (3, 2)], id="every-decode-runs-beside-the-budget"),
        pytest.param([decode(0), decode(1), prefill(2, 4)], 3, [(0, 1), (1, 1), (2, 3)], id="prompt-chunks-are-budget-sized"),
        pytest.param([prefill(0, 2), prefill(1, 4)], 3, [(0, 2)], id="a-chunk-is-never-split-by-leftovers"),
        pytest.param([decode(0, buffered=EVENT_BUFFER), decode(1)], 8, [(1, 1)], id="paused-reader-skipped"),
        pytest.param([decode(0, buffered=EVENT_BUFFER - 1), decode(1)], 8, [(0, 1), (1, 1)], id="almost-paused-still-runs"),
        pytest.param([decode(0, finished=True), prefill(1, 2)], 8, [(1, 2)], id="finished-skipped"),
        pytest.param([make_seq(0, []), decode(1)], 8, [(1, 1)], id="nothing-pending-skipped"),
        pytest.param([prefill(0, 3), make_seq(1, [9], position=5)], 8, [(0, 3), (1, 1)], id="one-token-prompt-is-not-a-decode"),
        pytest.param([], 8, [], id="no-sequences"),
    ],
)
def test_plan_step(sequences, budget, expected):
    plan = plan_step(sequences, budget)
    assert [(seq.id, count) for seq, count in plan] == expected
    prompt_tokens = sum(count for seq, count in plan if not seq.decoding)
    assert prompt_tokens <= budget  # decode tokens ride on top of the budget


def test_plan_step_starts_a_long_prompt_while_another_sequence_decodes():
    waiting = prefill(1, 40)
    plan = plan_step([decode(0), waiting], 16)
    assert [(seq.id, count) for seq, count in plan] == [(0, 1), (1, 16)]


def test_build_batch_rows_positions_and_sequences_follow_the_plan():
    a, b = make_seq(0, [11, 12, 13, 14], position=2), decode(1, position=30)
    batch, _ = build_batch([(b, 1), (a, 3)])
    assert batch.inputs.tolist() == [8, 11, 12, 13]
    assert batch.positions.tolist() == [30, 2, 3, 4]
    assert batch.sequences.tolist() == [1, 0, 0, 0]
    assert all(array.dtype == np.int64 for array in (batch.inputs, batch.positions, batch.sequences, batch.outputs))


@pytest.mark.parametrize(
    ("counts", "pending", "outputs", "emitting"),
    [
        pytest.param([1, 4], [1, 4], [0, 4], [0, 1], id="all-consumed-every-sequence-emits"),
        pytest.param([1, 3], [1, 4], [0], [0], id="partial-prompt-chunk-no-output"),
        pytest.param([2, 1], [4, 1], [2], [1], id="only-the-completed-one"),
        pytest.param([3, 2], [5, 6], [], [], id="both-partial"),
    ],
)
def test_build_batch_outputs_only_where_pending_tokens_are_consumed(counts, pending, outputs, emitting):
    seqs = [make_seq(i, list(range(n)), generated=int(n == 1)) for i, n in enumerate(pending)]
    batch, emitters = build_batch(list(zip(seqs, counts)))
    assert batch.outputs.tolist() == outputs
    assert [seq.id for seq in emitters] == emitting
