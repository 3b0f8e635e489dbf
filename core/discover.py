"""What this machine has: NVIDIA GPUs (through NVML), the CPU and its instruction sets, memory.

Discovery never fails: without an NVIDIA driver (or without nvidia-ml-py) it reports no GPUs and
says why in `SystemInfo.driver_error`. The default context length follows from the GPU memory.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from collections.abc import Mapping

import attrs

log = logging.getLogger(__name__)

GiB = 1 << 30
# Default num_ctx by total GPU memory, largest tier first (Ollama's tiers).
CONTEXT_TIERS = ((47 * GiB, 262144), (23 * GiB, 32768))
FALLBACK_NUM_CTX = 4096
CONTEXT_ENV = ("CORRAL_CONTEXT_LENGTH", "OLLAMA_CONTEXT_LENGTH")
# Instruction sets worth naming in the start-up summary; `CPUInfo.features` keeps every flag.
NOTABLE_FEATURES = (
    "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "asimddp", "i8mm", "bf16", "sve", "sve2",
)  # fmt: skip


@attrs.frozen
class GPUInfo:
    """One NVIDIA GPU as NVML sees it (`index` is NVML's, which orders by PCI bus)."""

    index: int
    name: str
    total_bytes: int
    free_bytes: int
    compute_capability: tuple[int, int]
    driver: str
    uuid: str = ""


@attrs.frozen
class CPUInfo:
    """The CPU: model name, physical and logical cores, /proc/cpuinfo flags, system memory."""

    model: str
    physical_cores: int
    logical_cores: int
    features: frozenset[str] = frozenset()
    memory_total_bytes: int | None = None
    memory_available_bytes: int | None = None


@attrs.frozen
class SystemInfo:
    """GPUs, CPU, and why there are no GPUs when NVML could not be used."""

    gpus: tuple[GPUInfo, ...]
    cpu: CPUInfo
    driver_error: str | None = None

    @property
    def total_gpu_bytes(self) -> int:
        return sum(gpu.total_bytes for gpu in self.gpus)


def discover() -> SystemInfo:
    """GPUs, CPU and memory of this machine; never raises."""
    gpus, driver_error = _nvidia_gpus()
    visible = _visible(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return SystemInfo(gpus=visible, cpu=_cpu(), driver_error=driver_error)


@functools.cache
def system_info() -> SystemInfo:
    """`discover()`, run once per process."""
    return discover()


def default_num_ctx(info: SystemInfo) -> int:
    """The context length to use when nothing sets one, by total GPU memory summed over all GPUs.

    Summed, as Ollama does: a model split over two 24 GiB GPUs has the room of one 48 GiB GPU.
    Whether one model actually fits is the memory estimate's call (`fits` in `effective_num_ctx`).
    """
    total = info.total_gpu_bytes
    for threshold, num_ctx in CONTEXT_TIERS:
        if total >= threshold:
            return num_ctx
    return FALLBACK_NUM_CTX


def context_default(info: SystemInfo, environ: Mapping[str, str] | None = None) -> int:
    """CORRAL_CONTEXT_LENGTH (or OLLAMA_CONTEXT_LENGTH) when set to a positive integer, else the memory default."""
    environ = os.environ if environ is None else environ
    for key in CONTEXT_ENV:
        value = environ.get(key, "").strip()
        if not value:
            continue
        try:
            parsed = int(value)
        except ValueError:
            parsed = 0
        if parsed > 0:
            return parsed
        log.warning("%s=%r is not a positive integer; ignoring it", key, value)
    return default_num_ctx(info)


def effective_num_ctx(
    requested: int | None, trained: int, fits: int | None, env_default: int, *, model: str = ""
) -> int:
    """The context a model runs with: the requested (request or Modelfile) value, else `env_default`,
    clamped to the model's trained context and to what fits in memory.

    Asking for more than the model was trained on logs a warning; the defaults are clamped quietly.
    """
    wanted = requested or env_default
    num_ctx = wanted
    if trained > 0 and wanted > trained:
        if requested:
            log.warning(
                "%srequested num_ctx %d exceeds the model's trained context %d; using %d",
                f"{model}: " if model else "", requested, trained, trained,
            )
        num_ctx = trained
    if fits is not None and fits < num_ctx:
        log.info("%snum_ctx %d does not fit in memory; using %d", f"{model}: " if model else "", num_ctx, fits)
        num_ctx = fits
    return max(num_ctx, 1)


def describe(info: SystemInfo) -> str:
    """A one-line summary for the start-up log."""
    if info.gpus:
        gpus = "; ".join(
            f"GPU {gpu.index} {gpu.name} (compute {gpu.compute_capability[0]}.{gpu.compute_capability[1]}, "
            f"{_gib(gpu.free_bytes)}/{_gib(gpu.total_bytes)} GiB free)"
            for gpu in info.gpus
        )
        gpus += f", driver {info.gpus[0].driver}"
    elif info.driver_error:
        gpus = f"no NVIDIA GPU ({info.driver_error})"
    else:
        gpus = "no NVIDIA GPU"
    cpu = info.cpu
    features = " ".join(name for name in NOTABLE_FEATURES if name in cpu.features) or "no SIMD flags found"
    memory = ""
    if cpu.memory_total_bytes:
        available = _gib(cpu.memory_available_bytes) if cpu.memory_available_bytes is not None else "?"
        memory = f", RAM {available}/{_gib(cpu.memory_total_bytes)} GiB available"
    return (
        f"{gpus}; CPU {cpu.model} ({cpu.physical_cores} cores, {cpu.logical_cores} threads; {features}){memory}; "
        f"default context {default_num_ctx(info)}"
    )


def _gib(count: int) -> str:
    return f"{count / GiB:.1f}"


# --- NVIDIA -------------------------------------------------------------------------------------
def _nvidia_gpus() -> tuple[tuple[GPUInfo, ...], str | None]:
    """The GPUs NVML reports, or none and the reason. The only place that touches pynvml."""
    try:
        import pynvml
    except ImportError:
        return (), "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as error:  # NVMLError (no driver, no library) or a ctypes failure: no GPUs, not a crash
        return (), f"NVML unavailable: {_reason(error)}"
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            gpus.append(
                GPUInfo(
                    index=index,
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    total_bytes=int(memory.total),
                    free_bytes=int(memory.free),
                    compute_capability=(int(major), int(minor)),
                    driver=driver,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                )
            )
        return tuple(gpus), None
    except Exception as error:  # a driver that answers nvmlInit but fails a query
        return (), f"NVML query failed: {_reason(error)}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # shutting down a half-working NVML must not hide what we found
            pass


def _visible(gpus: tuple[GPUInfo, ...], spec: str | None) -> tuple[GPUInfo, ...]:
    """The GPUs CUDA_VISIBLE_DEVICES leaves visible (indices or UUID prefixes; CUDA stops at the first bad entry)."""
    if spec is None:
        return gpus
    chosen: list[GPUInfo] = []
    for token in (part.strip() for part in spec.split(",")):
        match = [gpu for gpu in gpus if _names(gpu, token)]
        if len(match) != 1 or match[0] in chosen:
            break
        chosen.append(match[0])
    return tuple(chosen)


def _names(gpu: GPUInfo, token: str) -> bool:
    if token.isdigit():
        return gpu.index == int(token)
    return token.startswith("GPU-") and gpu.uuid.startswith(token)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _reason(error: BaseException) -> str:
    return str(error) or type(error).__name__


# --- CPU and memory -----------------------------------------------------------------------------
def _cpu() -> CPUInfo:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            cpu_text = cpuinfo.read()
    except OSError:
        cpu_text = ""
    try:
        with open("/proc/meminfo", encoding="utf-8", errors="replace") as meminfo:
            mem_text = meminfo.read()
    except OSError:
        mem_text = ""
    return parse_cpu(cpu_text, mem_text)


def parse_cpu(cpuinfo: str, meminfo: str = "") -> CPUInfo:
    """CPUInfo from the text of /proc/cpuinfo and /proc/meminfo (either may be empty)."""
    model, features, logical, cores = "", frozenset(), 0, set()
    for block in cpuinfo.split("\n\n"):
        fields = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        if "processor" not in fields:
            continue
        logical += 1
        model = model or fields.get("model name") or fields.get("Model") or fields.get("cpu model", "")
        features = features or frozenset((fields.get("flags") or fields.get("Features") or "").split())
        core_id = fields.get("core id")
        # Without core ids (ARM, some VMs) every logical processor counts as a core.
        cores.add((fields.get("physical id", ""), core_id) if core_id is not None else ("cpu", fields["processor"]))
    logical = logical or os.cpu_count() or 1
    memory = _meminfo(meminfo)
    return CPUInfo(
        model=model or platform.processor() or platform.machine() or "unknown",
        physical_cores=len(cores) or logical,
        logical_cores=logical,
        features=features,
        memory_total_bytes=memory.get("MemTotal"),
        memory_available_bytes=memory.get("MemAvailable"),
    )


def _meminfo(text: str) -> dict[str, int]:
    sizes = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        parts = value.split()
        if sep and parts and parts[0].isdigit():
            sizes[key.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return sizes
