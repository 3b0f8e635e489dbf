"""Tensor parallelism over gloo on CPU: a model split over 2 and 3 rank processes computes what one process does.

The split layers are nn.py's (q/k/v and gate/up by columns, output and down by rows); the rank
processes are corral's own (corral.parallel.ranks). Reference precision (fp32) sums the partial
products in another order than one matmul, so logits agree to float rounding, not bit for bit.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import trio

from corral.engine import load_model
from corral.parallel.shards import RankFailedError, TensorParallelError
from corral.runner.runtime import Runtime
from conftest import TINY_LLAMA
from split_models import GREEDY, PROMPT, PROMPTS, greedy_tokens
from tiny_gguf import write_tiny_llama

pytestmark = pytest.mark.slow  # rank processes: out of the fast subset (-m "not slow")


# Heads each rank count splits: 4 heads over 2 KV heads (tp=2 splits both); 6 heads over 3 KV heads
# (tp=3: one KV head a rank); 4 heads over 1 KV head (tp=2 replicates it). Widths keep whole Q8_0
# blocks per rank for the row-split ffn_down.
SPLITS = {
    "tp2": (2, {}),
    "tp3": (3, dict(embedding_length=96, head_count=6, head_count_kv=3, feed_forward_length=192)),
    "tp2-replicated-kv": (2, dict(head_count_kv=1)),
}


@pytest.fixture(scope="module", params=list(SPLITS))
def split(request, tmp_path_factory):
    """(tiny model path, ranks, its tp=1 model, its tensor-parallel model), both fp32."""
    ranks, config = SPLITS[request.param]
    path = write_tiny_llama(tmp_path_factory.mktemp("tp") / "tiny.gguf", **config)
    whole = load_model(path, precision="fp32")
    split = load_model(path, precision="fp32", tensor_parallel=ranks)
    yield path, ranks, whole, split
    split.close()


def test_split_logits_match_one_process(split):
    _, _, whole, parallel = split
    expected, got = whole.logits(PROMPT), parallel.logits(PROMPT)
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() < 1e-5


async def test_split_greedy_tokens_match_one_process_batched(split):
    _, _, whole, parallel = split
    assert await greedy_tokens(parallel) == await greedy_tokens(whole)


async def test_a_cancelled_request_leaves_the_split_model_serving(split):
    _, _, whole, parallel = split
    expected = (await greedy_tokens(whole))[PROMPTS.index("a")]
    async with Runtime.open(parallel, num_parallel=2, num_ctx=64) as rt:
        async with rt.generate("the cat sat", dict(GREEDY, num_predict=40), raw=True) as stream:
            async for _ in stream:
                break  # leaving the block cancels the sequence mid-generation; its cells are freed on every rank
        async with rt.generate("a", dict(GREEDY), raw=True) as stream:
            assert [t async for chunk in stream for t in chunk.token_ids] == expected


async def test_the_scheduler_splits_by_the_environment_and_the_request_option(tiny_store_root, monkeypatch, nursery):
    from corral.scheduler import Scheduler
    from corral.store import Store

    monkeypatch.setenv("CORRAL_TENSOR_PARALLEL", "2")
    scheduler = await nursery.start(Scheduler(Store(tiny_store_root), runner="inprocess").run)
    async with scheduler.use(TINY_LLAMA) as entry:
        assert entry.runtime.model.ranks.world == 2
    async with scheduler.use(TINY_LLAMA, {"tensor_parallel": 1}) as entry:  # a load-time option: reloaded whole
        assert entry.runtime.model.ranks is None


async def test_the_scheduler_refuses_a_split_the_model_cannot_take_before_starting_a_runner(tiny_store_root, nursery):
    from corral.scheduler import Scheduler
    from corral.store import Store

    scheduler = await nursery.start(Scheduler(Store(tiny_store_root), runner="process").run)
    with trio.fail_after(5):  # no runner process started: it would take longer
        with pytest.raises(TensorParallelError, match="does not divide the model's 4 attention heads"):
            async with scheduler.use(TINY_LLAMA, {"tensor_parallel": 3}):
                pass


def test_kv_cache_holds_only_the_ranks_heads(split):
    _, ranks, whole, parallel = split
    full, local = whole.new_cache(8), parallel.new_cache(8)
    kv_heads = full.keys[0].shape[0]
    assert local.keys[0].shape[0] == max(1, kv_heads // ranks)


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}  # /proc/net/tcp{,6}'s hex


def listening_addresses(pids: list[int]) -> list[str]:
    """The local addresses (as /proc/net/tcp writes them) of the TCP sockets these processes listen on."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN
                    found.append(fields[1].split(":")[0])
    return found


def test_ranks_listen_on_loopback_only(split):
    _, _, _, parallel = split
    addresses = listening_addresses([os.getpid(), *parallel.ranks.pids])
    assert addresses and set(addresses) <= LOOPBACK


def test_heads_that_do_not_split_are_refused(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")  # 4 heads: not over 3 ranks
    with pytest.raises(TensorParallelError, match="does not divide the model's 4 attention heads"):
        load_model(path, precision="fp32", tensor_parallel=3)


async def test_a_killed_rank_ends_the_runtime_with_a_clear_error(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    with pytest.raises(BaseExceptionGroup) as raised:
        with trio.fail_after(60):
            async with Runtime.open(path, precision="fp32", tensor_parallel=2, num_ctx=64) as rt:
                (pid,) = rt.model.ranks.pids
                os.kill(pid, signal.SIGKILL)
                async with rt.generate("the cat sat", dict(GREEDY), raw=True) as stream:
                    async for _ in stream:
                        pass
    assert raised.group_contains(RankFailedError, match="rank 1 .exit code -9")


def test_smollm2_over_three_ranks_matches_one_process(smollm2_path):
    # 9 heads over 3 KV heads: 3 query heads and 1 KV head a rank; 576 / 3 and 1536 / 3 keep whole blocks.
    whole = load_model(smollm2_path, precision="fp32")
    split = load_model(smollm2_path, precision="fp32", tensor_parallel=3)
    try:
        ids = whole.tokenize("The capital of France is")
        expected, got = whole.logits(ids), split.logits(ids)
        # 30 blocks of reassociated float32 sums: 4.8e-5 apart at most on logits up to 27 (measured), 1e-5 of their scale.
        assert np.abs(got - expected).max() < 1e-5 * np.abs(expected).max()
        assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
        assert list(whole.generate("Name a colour.", max_tokens=16)) == list(split.generate("Name a colour.", max_tokens=16))
    finally:
        split.close()


def children(pid: int) -> list[int]:
    """The processes `pid` started, from /proc."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


async def test_a_killed_rank_takes_its_runner_process_down_and_the_scheduler_sees_it(tmp_path):
    from corral.runner.process import RunnerDiedError, RunnerProcess

    path = write_tiny_llama(tmp_path / "tiny.gguf")
    async with RunnerProcess.open(path, tensor_parallel=2, num_parallel=1, num_ctx=64) as runner:
        # Rank 1 is forked by the runner's forkserver.
        (forkserver,) = [pid for pid in children(runner.pid) if "forkserver" in cmdline(pid)]
        (rank,) = children(forkserver)
        os.kill(rank, signal.SIGKILL)
        with trio.fail_after(60):
            with pytest.raises(RunnerDiedError):
                async with runner.generate("the cat sat", dict(GREEDY), raw=True) as stream:
                    async for _ in stream:
                        pass
            await runner.exited.wait()  # what the scheduler watches to drop the model
        assert not runner.alive
