"""Discovery against a fake NVML, the default-context tiers, and the effective context."""

import logging
import pathlib
import sys
import types

import pytest

from corral import discover
from corral.discover import GiB, context_default, default_num_ctx, describe, effective_num_ctx, parse_cpu

CPUINFO = """\
processor	: 0
vendor_id	: GenuineIntel
model name	: Intel(R) Xeon(R) Platinum 8480+
physical id	: 0
core id		: 0
flags		: fpu sse4_2 avx avx2 fma f16c avx512f avx512bw avx512_bf16 amx_tile amx_bf16 amx_int8

processor	: 1
model name	: Intel(R) Xeon(R) Platinum 8480+
physical id	: 0
core id		: 0
flags		: fpu sse4_2 avx avx2 fma f16c avx512f avx512bw avx512_bf16 amx_tile amx_bf16 amx_int8

processor	: 2
model name	: Intel(R) Xeon(R) Platinum 8480+
physical id	: 0
core id		: 1
flags		: fpu sse4_2 avx avx2 fma f16c avx512f avx512bw avx512_bf16 amx_tile amx_bf16 amx_int8

"""
MEMINFO = "MemTotal:       32768000 kB\nMemFree:         1000000 kB\nMemAvailable:   16384000 kB\n"


class FakeNVMLError(Exception):
    pass


def fake_nvml(*gpus_gib: float, fail_init: str | None = None) -> types.ModuleType:
    """A stand-in `pynvml` module reporting GPUs of the given sizes (GiB)."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = FakeNVMLError
    nvml.shutdowns = 0

    def init():
        if fail_init:
            raise FakeNVMLError(fail_init)

    def shutdown():
        nvml.shutdowns += 1

    nvml.nvmlInit = init
    nvml.nvmlShutdown = shutdown
    nvml.nvmlSystemGetDriverVersion = lambda: "570.86.15"
    nvml.nvmlDeviceGetCount = lambda: len(gpus_gib)
    nvml.nvmlDeviceGetHandleByIndex = lambda index: index
    nvml.nvmlDeviceGetName = lambda handle: b"NVIDIA Fake" if handle else "NVIDIA Fake"  # old bindings return bytes
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(
        total=int(gpus_gib[handle] * GiB), free=int(gpus_gib[handle] * GiB) - GiB, used=GiB
    )
    nvml.nvmlDeviceGetCudaComputeCapability = lambda handle: (9, 0)
    nvml.nvmlDeviceGetUUID = lambda handle: f"GPU-{handle:08d}-fake"
    return nvml


@pytest.fixture
def use_nvml(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def install(nvml):
        monkeypatch.setitem(sys.modules, "pynvml", nvml)
        return nvml

    return install


@pytest.mark.parametrize(
    ("gib", "expected"),
    [(80, 262144), (47, 262144), (46.9, 32768), (24, 32768), (23, 32768), (22.9, 4096), (8, 4096)],
)
def test_default_context_follows_gpu_memory_tiers(use_nvml, gib, expected):
    use_nvml(fake_nvml(gib))
    assert default_num_ctx(discover.discover()) == expected


def test_default_context_sums_memory_over_gpus(use_nvml):
    use_nvml(fake_nvml(24, 24))
    info = discover.discover()
    assert [gpu.total_bytes for gpu in info.gpus] == [24 * GiB, 24 * GiB]
    assert default_num_ctx(info) == 262144  # 48 GiB in all, though neither GPU alone reaches 47


def test_gpu_fields_come_from_nvml(use_nvml):
    nvml = use_nvml(fake_nvml(80, 24))
    info = discover.discover()
    first, second = info.gpus
    assert (first.index, first.name, first.compute_capability, first.driver) == (0, "NVIDIA Fake", (9, 0), "570.86.15")
    assert second.name == "NVIDIA Fake"  # decoded from bytes
    assert (second.total_bytes, second.free_bytes) == (24 * GiB, 23 * GiB)
    assert info.driver_error is None
    assert nvml.shutdowns == 1


def test_no_driver_means_no_gpus_and_says_why(use_nvml):
    nvml = use_nvml(fake_nvml(80, fail_init="Driver Not Loaded"))
    info = discover.discover()
    assert info.gpus == ()
    assert "Driver Not Loaded" in info.driver_error
    assert default_num_ctx(info) == 4096
    assert nvml.shutdowns == 0  # never initialised, so never shut down
    assert "no NVIDIA GPU (NVML unavailable: Driver Not Loaded)" in describe(info)


def test_missing_nvml_library_means_no_gpus(use_nvml, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    info = discover.discover()
    assert info.gpus == () and info.driver_error == "nvidia-ml-py is not installed"


def test_a_failing_query_after_init_still_returns_and_shuts_down(use_nvml):
    nvml = fake_nvml(80)

    def broken(handle):
        raise FakeNVMLError("GPU is lost")

    nvml.nvmlDeviceGetMemoryInfo = broken
    use_nvml(nvml)
    info = discover.discover()
    assert info.gpus == () and "GPU is lost" in info.driver_error
    assert nvml.shutdowns == 1


@pytest.mark.parametrize(("visible", "expected"), [("1", [1]), ("1,0", [1, 0]), ("", []), ("-1", []), ("GPU-00000001", [1])])
def test_cuda_visible_devices_limits_the_gpus(use_nvml, monkeypatch, visible, expected):
    use_nvml(fake_nvml(80, 24))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert [gpu.index for gpu in discover.discover().gpus] == expected


def test_describe_names_gpus_driver_cpu_and_default_context(use_nvml):
    use_nvml(fake_nvml(80))
    line = describe(discover.discover())
    assert "GPU 0 NVIDIA Fake (compute 9.0, 79.0/80.0 GiB free)" in line
    assert "driver 570.86.15" in line
    assert line.endswith("default context 262144")
    assert "\n" not in line


def test_cpu_info_parses_cores_features_and_memory():
    cpu = parse_cpu(CPUINFO, MEMINFO)
    assert cpu.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert (cpu.physical_cores, cpu.logical_cores) == (2, 3)
    assert {"avx2", "avx512f", "avx512_bf16", "amx_bf16"} <= cpu.features
    assert "avx512_fp16" not in cpu.features
    assert cpu.memory_total_bytes == 32768000 * 1024
    assert cpu.memory_available_bytes == 16384000 * 1024


def test_cpu_info_without_proc_files_falls_back():
    cpu = parse_cpu("", "")
    assert cpu.logical_cores >= 1 and cpu.physical_cores == cpu.logical_cores
    assert cpu.features == frozenset() and cpu.memory_total_bytes is None


@pytest.mark.skipif(not pathlib.Path("/proc/cpuinfo").exists(), reason="needs Linux /proc")
def test_cpu_info_reads_this_machine():
    cpu = discover.discover().cpu
    flags = next(line for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("flags", "Features")))
    assert cpu.features == frozenset(flags.partition(":")[2].split())
    assert 1 <= cpu.physical_cores <= cpu.logical_cores
    assert cpu.memory_total_bytes > cpu.memory_available_bytes > 0


@pytest.mark.parametrize(
    ("requested", "trained", "fits", "env_default", "expected"),
    [
        (None, 8192, None, 4096, 4096),  # the default, under the trained context
        (None, 8192, None, 262144, 8192),  # a large default is clamped to the trained context
        (2048, 8192, None, 262144, 2048),  # the request wins over the default
        (16384, 8192, None, 4096, 8192),  # a request above the trained context is clamped
        (None, 131072, 20000, 32768, 20000),  # clamped to what fits in memory
        (65536, 131072, 20000, 4096, 20000),
        (None, 0, None, 4096, 4096),  # unknown trained context: no clamp
    ],
)
def test_effective_context(requested, trained, fits, env_default, expected):
    assert effective_num_ctx(requested, trained, fits, env_default) == expected


def test_request_above_trained_context_logs_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="corral.discover"):
        effective_num_ctx(16384, 8192, None, 4096, model="smollm2:latest")
    assert [r.getMessage() for r in caplog.records] == [
        "smollm2:latest: requested num_ctx 16384 exceeds the model's trained context 8192; using 8192"
    ]


def test_default_above_trained_context_is_clamped_quietly(caplog):
    with caplog.at_level(logging.WARNING, logger="corral.discover"):
        effective_num_ctx(None, 8192, None, 262144)
    assert caplog.records == []


def test_environment_sets_the_default_before_memory():
    info = discover.SystemInfo(gpus=(), cpu=parse_cpu(CPUINFO))
    assert context_default(info, {"OLLAMA_CONTEXT_LENGTH": "8192"}) == 8192
    assert context_default(info, {"CORRAL_CONTEXT_LENGTH": "16384", "OLLAMA_CONTEXT_LENGTH": "8192"}) == 16384
    assert context_default(info, {"CORRAL_CONTEXT_LENGTH": "lots"}) == 4096
    assert context_default(info, {}) == 4096
