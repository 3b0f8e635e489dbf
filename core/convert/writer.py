"""Write a GGUF from a Hugging Face folder with gguf-py's GGUFWriter: metadata, tokenizer, tensors.

The output type follows the folder's, like llama.cpp's `--outtype auto` except for float32: the first
matrix decides, BF16 stays BF16, F16 stays F16, and F32 stays F32 (llama.cpp's auto would halve it
to F16; corral keeps the reference precision and leaves smaller types to quantization). Vectors,
norms, biases and the few matrices llama.cpp always keeps wide (router, position and token-type
embeddings) are F32 whatever the output type.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from corral.convert.architectures import family_of
from corral.convert.family import TextFamily
from corral.convert.folder import ConvertError, HFFolder
from corral.convert.vocab import TOKENIZER_MODEL, load_tokenizer

log = logging.getLogger(__name__)

FILE_TYPES = {
    torch.float32: (gguf.LlamaFileType.ALL_F32, gguf.GGMLQuantizationType.F32),
    torch.float16: (gguf.LlamaFileType.MOSTLY_F16, gguf.GGMLQuantizationType.F16),
    torch.bfloat16: (gguf.LlamaFileType.MOSTLY_BF16, gguf.GGMLQuantizationType.BF16),
}
# Matrices llama.cpp keeps in F32 whatever the output type.
ALWAYS_F32 = (
    gguf.MODEL_TENSOR.FFN_GATE_INP,
    gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP,
    gguf.MODEL_TENSOR.POS_EMBD,
    gguf.MODEL_TENSOR.TOKEN_TYPES,
)

VocabWriter = Callable[[gguf.GGUFWriter, HFFolder], None]


def check_folder(path: str | os.PathLike) -> TextFamily:
    """Everything `convert_folder` needs, checked without reading a weight: config, architecture, tokenizer, tensor names."""
    folder = HFFolder.open(path)
    family = family_of(folder)
    if not folder.has(TOKENIZER_MODEL):
        load_tokenizer(folder)
    for name in folder.weights:
        if not family.skip(name) and not family.regroups(family.rename(name)):
            gguf_name(family, family.rename(name))
    return family


def gguf_name(family: TextFamily, name: str) -> str:
    """The GGUF name of a (renamed) folder tensor; a ConvertError for one gguf's map does not know."""
    mapped = family.tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
    if mapped is None:
        raise ConvertError(f"{family.folder.path}: tensor {name} has no GGUF name in {family.arch_name}")
    return mapped


def convert_folder(path: str | os.PathLike, out: str | os.PathLike, vocab: VocabWriter | None = None) -> Path:
    """Convert the model folder at `path` to the GGUF file `out`; `vocab`, where given, writes the tokenizer
    keys instead of the family's own reading of the folder's tokenizer."""
    folder = HFFolder.open(path)
    family = family_of(folder)
    file_type, tensor_type = FILE_TYPES.get(folder.first_matrix_dtype(), FILE_TYPES[torch.float32])
    writer = gguf.GGUFWriter(path=None, arch=family.arch_name)
    add_tensors(writer, family, tensor_type)
    writer.add_type(gguf.GGUFType.MODEL)
    add_provenance(writer, folder)
    family.add_parameters(writer)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if vocab is None:
        family.add_vocab(writer)
    else:
        vocab(writer, folder)
    return write_out(writer, out)


def write_out(writer: gguf.GGUFWriter, out: str | os.PathLike) -> Path:
    """Write everything added to `writer` into the file `out` and close it."""
    out = Path(out)
    writer.write_header_to_file(path=out)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def add_provenance(writer: gguf.GGUFWriter, folder: HFFolder) -> None:
    """The general.* keys of the model card (README.md's front matter, config's _name_or_path) via gguf.Metadata."""
    total, shared, expert, experts = writer.get_total_parameter_count()
    metadata = gguf.Metadata.load(None, folder.path, None, total)
    if metadata.name is None:
        metadata.name = folder.path.name
    if metadata.size_label is None and total > 0:
        metadata.size_label = gguf.size_label(total, shared, expert, experts)
    metadata.set_gguf_meta_model(writer)


def add_tensors(writer: gguf.GGUFWriter, family: TextFamily, tensor_type: gguf.GGMLQuantizationType) -> None:
    """Every tensor under its GGUF name, rewritten as the family says, in its GGUF type."""
    for name, tensor in family.extra_tensors():
        writer.add_tensor(name, tensor.numpy(), raw_dtype=gguf.GGMLQuantizationType.F32)
    for name, tensor in family.folder.tensors():
        if family.skip(name):
            continue
        name = family.rename(name)
        if tensor.dtype not in (torch.float16, torch.float32):
            tensor = tensor.to(torch.float32)
        for name, tensor in family.tensors(name, tensor):
            target = gguf_name(family, name)
            qtype = stored_type(family, target, tensor.ndim, tensor_type)
            writer.add_tensor(target, gguf.quants.quantize(np.ascontiguousarray(tensor.numpy()), qtype), raw_dtype=qtype)
    family.finish()


def stored_type(family: TextFamily, name: str, dims: int, wanted: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """F32 for what llama.cpp keeps wide (vectors, norms, biases, ALWAYS_F32), else the output type."""
    if dims <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return gguf.GGMLQuantizationType.F32
    wide = {gguf.TENSOR_NAMES[kind].format(bid=i) + ".weight" for kind in ALWAYS_F32 for i in range(family.blocks)}
    return gguf.GGMLQuantizationType.F32 if name in wide else wanted
