"""benchmarks/load.py, short and bounded, against a real `corral serve` on a tiny model: every client
gets an answer or a 503, none fails, and the figures are reported."""

import importlib.util
import pathlib

import pytest
from conftest import TINY_LLAMA
from serve_process import ServeProcess

pytestmark = pytest.mark.slow  # hundreds of clients against a server: out of the fast subset (-m "not slow")



def load_benchmark():
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "load.py"
    spec = importlib.util.spec_from_file_location("load_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_load_benchmark_gets_every_client_an_answer_or_a_503(tiny_store_root):
    with ServeProcess(tiny_store_root, env={"CORRAL_MAX_QUEUE": "8", "CORRAL_NUM_PARALLEL": "4"}) as served:
        figures = load_benchmark().main(["--url", served.url, "--model", TINY_LLAMA, "--clients", "40", "--duration", "20",
                                         "--num-predict", "4"])
    assert figures["completed"] + figures["busy"] == 40 and figures["failed"] == figures["unfinished"] == 0
    assert figures["completed"] >= 4 and figures["busy"] > 0  # more clients than slots and queue: some are refused
    assert 0 < figures["ttft_p50_s"] <= figures["ttft_p99_s"]
    assert figures["rss_after"]["server_mib"] > 0 and figures["rss_after"]["runners_mib"] > 0
