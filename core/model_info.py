"""What a model is, read from its GGUF header alone: `ModelInfo` (what a runner reports about the model it
loaded), its parameter count and its quantization's name.

Apart from corral.engine, which loads the weights (numpy, torch through the backend), so that the routing
server can describe a model (/api/show, /api/tags, a runner's report) without importing either.
"""

from __future__ import annotations

import math

import attrs

from corral.ggml_types import LlamaFileType
from corral.gguf import GGUFFile


@attrs.frozen
class ModelInfo:
    """What `m.info` reports about a loaded model."""

    architecture: str
    name: str
    parameter_count: int
    quantization: str
    context_length: int
    file_size: int
    load_seconds: float


def quantization_name(gguf: GGUFFile) -> str:
    """The file type as Ollama shows it (`Q4_1`, `Q4_K_M`, `F16`)."""
    file_type = gguf.get("general.file_type")
    if file_type is None:
        return "unknown"
    try:
        return LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"type {file_type}"


def parameter_count(gguf: GGUFFile) -> int:
    """Total number of weights in the file."""
    return sum(math.prod(info.shape) for info in gguf.tensors.values())
