"""The memory estimate against the resident memory a real model takes once loaded and its context filled.

Measured on a loaded 2-core machine (BENCHMARKS.md, "Memory"): with the tokenizer and the attention scores
counted, the estimate is 38% under for smollm2 (219 MB against 350 MB) and 16% under for gemma3:270m
(442 MB against 526 MB): what the runtime keeps after a full prompt (heap kept for the next step, graph
caches) is not yet predicted. The tests say so (strict xfail) until it is.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("memory_probe.py")
TOLERANCE = 0.15
UNDER_PREDICTED = pytest.mark.xfail(strict=True, reason="runtime overhead after a full prompt is not in the estimate yet")


def measure(path: Path, num_ctx: int) -> dict:
    done = subprocess.run([sys.executable, str(PROBE), str(path), str(num_ctx)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@UNDER_PREDICTED
def test_the_smollm2_estimate_is_within_15_percent_of_its_resident_memory(smollm2_path):
    figures = measure(smollm2_path, 2048)
    assert figures["estimate"] == pytest.approx(figures["measured"], rel=TOLERANCE)


@UNDER_PREDICTED
def test_the_gemma3_estimate_is_within_15_percent_of_its_resident_memory(gemma3_path):
    figures = measure(gemma3_path, 2048)
    assert figures["estimate"] == pytest.approx(figures["measured"], rel=TOLERANCE)
