"""Where a split model's ranks compute and what carries their activations: gloo on the CPU, NCCL between GPUs,
one GPU a rank. Pure choices, checked without a GPU (the CPU runs of tests/test_tensor_parallel.py and
tests/test_pipeline_parallel.py exercise the gloo side end to end)."""

from __future__ import annotations

import pytest

from corral.parallel.ranks import collective_backend, rank_device, resolved_device
from corral.parallel.shards import TensorParallelError


@pytest.mark.parametrize(
    "device, backend", [("cpu", "gloo"), ("cuda", "nccl"), ("cuda:1", "nccl"), ("mps", "gloo")]
)
def test_activations_go_over_nccl_on_cuda_and_gloo_elsewhere(device, backend):
    assert collective_backend(device) == backend


def test_cuda_ranks_each_take_their_own_gpu_counting_from_the_one_asked_for():
    assert [rank_device("cuda", rank, 4) for rank in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [rank_device("cuda:2", rank, 4) for rank in range(2)] == ["cuda:2", "cuda:3"]


def test_cpu_ranks_share_the_cpu():
    assert [rank_device("cpu", rank, 8) for rank in range(3)] == ["cpu", "cpu", "cpu"]


def test_more_cuda_ranks_than_gpus_are_refused():
    with pytest.raises(TensorParallelError, match="needs CUDA device 2, and this host has 2"):
        rank_device("cuda", 2, 2)
    with pytest.raises(TensorParallelError, match="needs CUDA device 1, and this host has 1"):
        rank_device("cuda:0", 1, 1)


def test_no_device_asked_for_is_the_backends_default():
    import torch

    assert resolved_device("cpu") == "cpu" and resolved_device("cuda:1") == "cuda:1"
    assert resolved_device(None) == ("cuda" if torch.cuda.is_available() else "cpu")
