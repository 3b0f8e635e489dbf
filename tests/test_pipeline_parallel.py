"""Pipeline parallelism over gloo on CPU: a model's blocks in 2 stages, as processes on one machine, give the tokens one stage does.

The stages run the same ops on the same float32 hidden states as one process, so logits are equal
bit for bit. One test starts the second stage as a host would, torchrun-style
(`python -m corral.parallel` with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from corral.engine import load_model
from corral.parallel.pipeline import stage_blocks
from corral.parallel.shards import TensorParallelError
from conftest import TINY_LLAMA
from split_models import PROMPT, greedy_tokens
from tiny_gguf import write_tiny_llama

pytestmark = pytest.mark.slow  # stage processes: out of the fast subset (-m "not slow")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_tiny_llama(tmp_path_factory.mktemp("pp") / "tiny.gguf", block_count=3)


@pytest.mark.parametrize(
    ("blocks", "stages", "expected"),
    [(3, 2, [range(0, 2), range(2, 3)]), (4, 2, [range(0, 2), range(2, 4)]), (5, 3, [range(0, 2), range(2, 4), range(4, 5)])],
)
def test_stages_take_consecutive_blocks_as_even_as_they_go(blocks, stages, expected):
    assert [stage_blocks(blocks, stages, s) for s in range(stages)] == expected


def test_more_stages_than_blocks_are_refused(tiny):
    with pytest.raises(TensorParallelError, match="between 1 and the model's 3 blocks"):
        load_model(tiny, pipeline_parallel=4)


async def test_two_stages_give_one_stages_logits_and_tokens(tiny):
    whole = load_model(tiny, precision="fp32")
    staged = load_model(tiny, precision="fp32", pipeline_parallel=2)
    try:
        assert staged.model.stage.blocks == range(0, 2)
        assert staged.model.blocks[2] is None  # stage 0 never loaded the last block
        np.testing.assert_array_equal(staged.logits(PROMPT), whole.logits(PROMPT))
        assert await greedy_tokens(staged) == await greedy_tokens(whole)
    finally:
        staged.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_stage_launched_torchrun_style_serves_the_second_half(tiny):
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "1", "WORLD_SIZE": "2"}
    stage = subprocess.Popen([sys.executable, "-m", "corral.parallel", "--model", tiny, "--split", "pipeline"], env=env)
    try:
        staged = load_model(tiny, pipeline_parallel=2, master=("127.0.0.1", port))
        try:
            assert await greedy_tokens(staged) == await greedy_tokens(load_model(tiny))
        finally:
            staged.close()
        assert stage.wait(timeout=30) == 0  # it exits when rank 0 unloads the model
    finally:
        stage.kill()
        stage.wait()


async def test_the_scheduler_splits_into_stages_by_the_request_option(tiny_store_root, nursery):
    from corral.scheduler import Scheduler
    from corral.store import Store

    scheduler = await nursery.start(Scheduler(Store(tiny_store_root), runner="inprocess").run)
    async with scheduler.use(TINY_LLAMA, {"pipeline_parallel": 2}) as entry:
        assert entry.runtime.model.model.stage.blocks == range(0, 1)  # the tiny llama's 2 blocks, one a stage
        async with entry.runtime.generate("the cat sat", {"temperature": 0, "num_predict": 4, "ignore_eos": True}, raw=True) as stream:
            assert len([t async for chunk in stream for t in chunk.token_ids]) == 4
