"""The vision side of a multimodal Hugging Face folder to a projector GGUF: llama.cpp's `clip` file, Ollama's
`projector` layer, with the keys and tensors llama.cpp's converter writes for the same folder.

A folder whose `architectures` name a vision model converts to two files: the text model
(`writer.convert_folder`, whose families leave the tower out) and this one, the vision tower and its
projector (corral.convert.families.vision says how, per family). tests/test_convert_vision.py proves
both equal to llama.cpp's on tiny models made with transformers' own classes: Gemma 3 against
`convert_hf_to_gguf.py --mmproj`, LLaVA 1.5 against its LLaVA image-encoder converter.

Tensor types follow llama.cpp's choices for each family over the folder's own type (as for text
models, an F32 folder stays F32); a projector is never quantized by `create`'s QUANTIZE, as llama.cpp
leaves mmproj files alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import torch

from corral.convert.families.vision import Gemma3VisionFamily, LlavaVisionFamily
from corral.convert.folder import ConvertError, HFFolder
from corral.convert.vision_family import VisionFamily
from corral.convert.writer import write_out

VISION_FAMILIES: dict[str, type[VisionFamily]] = {
    "Gemma3ForConditionalGeneration": Gemma3VisionFamily,
    "LlavaForConditionalGeneration": LlavaVisionFamily,
}


def vision_family_of(folder: HFFolder) -> VisionFamily | None:
    """The vision family of config.json's `architectures`; None for a text-only model."""
    for name in folder.config.get("architectures") or []:
        if name in VISION_FAMILIES:
            return VISION_FAMILIES[name](folder)
    return None


def check_projector(folder: HFFolder) -> VisionFamily | None:
    """Everything `convert_projector` needs, checked without reading a weight; None for a text-only folder."""
    family = vision_family_of(folder)
    if family is None:
        return None
    names = family.names()
    if not names:
        raise ConvertError(f"{folder.path} names a vision model but holds no vision tower tensors ({', '.join(family.prefixes)})")
    for name in names:
        family.gguf_name(name)
    family.add_metadata(gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ]), family.file_type()[0])
    return family


def convert_projector(path: str | os.PathLike, out: str | os.PathLike) -> Path | None:
    """Write the projector GGUF of the vision model folder at `path` to `out`; None (nothing written) for a text-only model."""
    family = check_projector(HFFolder.open(path))
    if family is None:
        return None
    file_type, matrix_type = family.file_type()
    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    for name, tensor in family.tensors():
        target = family.gguf_name(name)
        if tensor.dtype not in (torch.float16, torch.float32):
            tensor = tensor.to(torch.float32)
        qtype = family.stored_type(name, target, tensor.ndim, matrix_type)
        writer.add_tensor(target, gguf.quants.quantize(np.ascontiguousarray(tensor.numpy()), qtype), raw_dtype=qtype)
    family.add_metadata(writer, file_type)
    return write_out(writer, out)
