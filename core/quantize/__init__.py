"""Quantizing a GGUF model as llama-quantize does: `create --quantize` and /api/create's `quantize`.

presets.py names the presets, mix.py picks each tensor's type, kquants.py quantizes the K-quant
blocks, driver.py rewrites the file. This module is the step `create` takes: check a base before
anything is written, then quantize it into a new model blob.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from corral.gguf import GGUFFile
from corral.quantize.driver import UNQUANTIZED, Progress, QuantizeError, plan, quantize_file
from corral.quantize.presets import Preset, UnknownQuantizationError, preset
from corral.store import Store

__all__ = ["QuantizeError", "UnknownQuantizationError", "check_quantizable", "quantize_file", "quantize_to_blob", "preset"]


def check_quantizable(path: str | os.PathLike, quantize: str) -> Preset:
    """The preset `quantize` names, once the GGUF at `path` is known to be quantizable to it.

    As Ollama does, only an unquantized model (F32, F16 or BF16 tensors) is quantized: quantizing a
    quantized one again would add the errors of both (llama-quantize needs --allow-requantize for it).
    """
    chosen = preset(quantize)
    source = GGUFFile.open(path)
    try:
        quantized = sorted({info.qtype.name for info in source.tensors.values() if info.qtype not in UNQUANTIZED})
        if quantized:
            raise QuantizeError(
                f"quantization is only supported for F32, F16 and BF16 models; this one has {', '.join(quantized)} tensors"
            )
        plan(source, chosen)
    finally:
        source.close()
    return chosen


def quantize_to_blob(store: Store, source: Path, chosen: Preset, progress: Progress | None = None) -> tuple[str, bool]:
    """Quantize the GGUF at `source` into a blob of `store`; returns its digest and whether it is new."""
    store.blobs_dir.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=store.blobs_dir, prefix=".quantizing-", suffix=".gguf")
    os.close(handle)
    try:
        quantize_file(source, name, chosen, progress=progress)
        with open(name, "rb") as file:
            digest = "sha256:" + hashlib.file_digest(file, "sha256").hexdigest()
        if store.has_blob(digest):
            return digest, False
        return store.write_blob(name, digest), True
    finally:
        Path(name).unlink(missing_ok=True)
