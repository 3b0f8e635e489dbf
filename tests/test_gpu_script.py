"""benchmarks/gpu.py on a CPU: it plans every conformance architecture and both real models, and its
conformance section runs end to end (device "cpu" against the CPU reference), so the script a CUDA
machine runs is known to import and to work before any GPU is at hand."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch
from tiny_gguf import WRITERS

pytestmark = pytest.mark.slow  # the GPU script's CPU dry run: out of the fast subset (-m "not slow")

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def expected_architectures() -> set[str]:
    return {name for name in WRITERS if name != "gpt2" or importlib.util.find_spec("corral_gpt2") is not None}


def test_plan_names_every_section_architecture_and_real_model():
    done = run_script("--plan")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout.strip().splitlines()[-1])
    assert plan["sections"] == ["environment", "conformance", "correctness", "speed", "http", "tp", "graphs"]
    assert plan["models"] == ["smollm2", "gemma3:270m"]
    assert set(plan["architectures"]) == expected_architectures()
    assert plan["sizes"]["batches"] == [1, 8, 32]
    # Tensor parallelism runs over 2.. CUDA devices: none here (gpu.tp_degrees, which the CUDA run plans with).
    assert plan["tensor_parallel"] == (list(range(2, torch.cuda.device_count() + 1)) if torch.cuda.is_available() else [])


def test_conformance_section_compares_architectures_on_cpu(tmp_path):
    # Two architectures keep it quick; test_conformance.py runs every one on the CPU already.
    out = tmp_path / "results.json"
    done = run_script("--device", "cpu", "--quick", "--sections", "environment", "conformance", "--architectures", "llama", "gemma3",
                      "--models", "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["problems"] == []
    conformance = results["conformance"]
    assert set(conformance) == {"llama", "gemma3"}
    for name, figures in conformance.items():
        assert figures["fp32_rel_diff"] == 0.0, name  # the same CPU fp32 path as the reference
        assert 0.0 < figures["auto_rel_diff"] < 5e-2, name  # bf16 and int4: close, not identical
    assert "| architecture |" in done.stdout  # the markdown table
