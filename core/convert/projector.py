"""The vision side of a multimodal Hugging Face folder to a projector GGUF: llama.cpp's `clip` file, with the
keys and tensor names `convert_hf_to_gguf.py --mmproj` writes for the same folder (Ollama's `projector` layer).

A folder whose `architectures` name a vision model (Gemma3ForConditionalGeneration) converts to two
files: the text model (`writer.convert_folder`, which leaves the tower out) and this one, the vision
tower and its projector. tests/test_convert_vision.py proves it equal to llama.cpp's converter on a tiny
Gemma 3 made with transformers' own classes: same keys and values, same tensors.

Tensor types follow llama.cpp's choices for the family, over the folder's own type (as for text models,
F32 stays F32): vectors and norms F32, Gemma 3's patch and position embeddings F32, its input
projection F16 (llama.cpp forces it so for ggml's matmul; the weights are the reference's either way).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from corral.convert.folder import ConvertError, HFFolder
from corral.convert.writer import FILE_TYPES, add_provenance, write_out

# The processor files whose image settings (mean, std, tokens per image) the projector keys take, in llama.cpp's
# order: the later one's values win; `processor_config.json` keeps them under `image_processor`.
PROCESSOR_FILES = (("preprocessor_config.json", "media_proc_cfg"), ("processor_config.json", "image_processor"))


class VisionFamily:
    """A vision tower (SigLIP-like) and projector, mapped onto gguf's MMPROJ tensor names and `clip.vision.*` keys."""

    projector_type: gguf.VisionProjectorType
    prefixes: tuple[str, ...] = ()  # the folder tensors that belong to the vision side

    def __init__(self, folder: HFFolder):
        self.folder = folder
        vision = folder.config.get("vision_config")
        if not isinstance(vision, dict):
            raise ConvertError(f"config.json in {folder.path} has no vision_config: the vision tower cannot be converted")
        self.vision = vision
        self.blocks = self.setting("num_hidden_layers")
        self.tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, self.blocks)
        self.processor = processor_settings(folder)

    def setting(self, key: str, default: Any = None) -> Any:
        """A vision_config value; a ConvertError naming it when it is missing and has no default."""
        value = self.vision.get(key, default)
        if value is None:
            raise ConvertError(f"config.json in {self.folder.path} says nothing of the vision tower's {key} (vision_config)")
        return value

    def owns(self, name: str) -> bool:
        return name.startswith(self.prefixes)

    def rename(self, name: str) -> str:
        """A folder tensor's name as gguf's MMPROJ map knows it."""
        return name

    def modify(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def forced_type(self, name: str) -> gguf.GGMLQuantizationType | None:
        """The type llama.cpp forces for a (renamed) folder tensor, whatever the output type; None when it forces none."""
        return None

    def gguf_name(self, name: str) -> str:
        mapped = self.tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ConvertError(f"{self.folder.path}: vision tensor {name} has no GGUF name in a projector")
        return mapped

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        """The keys every vision tower writes: its shape, the text model's width, the processor's normalisation."""
        writer.add_clip_has_vision_encoder(True)
        text_width = self.folder.config.get("hidden_size")
        if text_width is None:
            raise ConvertError(f"config.json in {self.folder.path} says nothing of the text model's hidden_size")
        writer.add_vision_projection_dim(text_width)
        writer.add_vision_image_size(self.setting("image_size"))
        writer.add_vision_patch_size(self.setting("patch_size"))
        writer.add_vision_embedding_length(self.setting("hidden_size"))
        writer.add_vision_feed_forward_length(self.setting("intermediate_size"))
        writer.add_vision_block_count(self.blocks)
        writer.add_vision_head_count(self.setting("num_attention_heads"))
        for add, key in ((writer.add_vision_image_mean, "image_mean"), (writer.add_vision_image_std, "image_std")):
            if key not in self.processor:
                raise ConvertError(f"{self.folder.path} has no image processor {key} (preprocessor_config.json): images could not be normalised")
            add(self.processor[key])
        writer.add_clip_projector_type(self.projector_type)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The vision side's (renamed, modified) folder tensors, read one at a time."""
        for name, tensor in self.folder.tensors():
            if self.owns(name):
                renamed = self.rename(name)
                if renamed is not None:
                    yield renamed, self.modify(renamed, tensor)


class Gemma3VisionFamily(VisionFamily):
    """Gemma 3: SigLIP (without its pooling head), then the soft-embedding RMSNorm (its +1 folded in) and the input projection."""

    projector_type = gguf.VisionProjectorType.GEMMA3
    prefixes = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
    DEFAULT_MERGE = 4  # what llama.cpp assumes when the file names no scale factor (every released size)

    def rename(self, name: str) -> str | None:
        if ".head." in name:
            return None  # SigLIP's pooling head: Gemma 3 reads the patch states
        name = name.removeprefix("model.")
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            # transformers 5 saves the tower flat; released checkpoints (and gguf's map) nest it
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        return name.replace("_weight", ".weight")  # multi_modal_projector.mm_input_projection_weight is a bare parameter

    def modify(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + 1.0 if "soft_emb_norm.weight" in name else tensor  # Gemma3RMSNorm multiplies by (1 + weight)

    def forced_type(self, name: str) -> gguf.GGMLQuantizationType | None:
        if "input_projection" in name:
            return gguf.GGMLQuantizationType.F16
        if ".embeddings." in name:
            return gguf.GGMLQuantizationType.F32
        return None

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        writer.add_vision_attention_layernorm_eps(self.vision.get("layer_norm_eps", 1e-6))
        writer.add_vision_use_gelu(True)
        per_side = int(self.processor.get("image_seq_length", 256) ** 0.5)  # tokens per image, a square
        merge = (self.setting("image_size") // self.setting("patch_size")) // per_side
        if merge > 0 and merge != self.DEFAULT_MERGE:
            writer.add_vision_projector_scale_factor(merge)


VISION_FAMILIES: dict[str, type[VisionFamily]] = {
    "Gemma3ForConditionalGeneration": Gemma3VisionFamily,
}


def vision_family_of(folder: HFFolder) -> VisionFamily | None:
    """The vision family of config.json's `architectures`; None for a text-only model."""
    for name in folder.config.get("architectures") or []:
        if name in VISION_FAMILIES:
            return VISION_FAMILIES[name](folder)
    return None


def processor_settings(folder: HFFolder) -> dict[str, Any]:
    """The image processor's settings, from preprocessor_config.json and processor_config.json merged."""
    settings: dict[str, Any] = {}
    for file, nested in PROCESSOR_FILES:
        found = folder.json(file)
        if isinstance(found, dict):
            settings |= found | (found.get(nested) if isinstance(found.get(nested), dict) else {})
    return settings


def check_projector(folder: HFFolder) -> VisionFamily | None:
    """Everything `convert_projector` needs, checked without reading a weight; None for a text-only folder."""
    family = vision_family_of(folder)
    if family is None:
        return None
    names = [renamed for name in folder.weights if family.owns(name) and (renamed := family.rename(name)) is not None]
    if not names:
        raise ConvertError(f"{folder.path} names a vision model but holds no vision tower tensors ({', '.join(family.prefixes)})")
    for name in names:
        family.gguf_name(name)
    family.add_parameters(gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ]))  # every setting it needs is there
    return family


def stored_type(family: VisionFamily, folder_name: str, name: str, dims: int, wanted: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """The family's forced type, else F32 for vectors, norms, biases and position embeddings, else the output type."""
    if dims <= 1 or name.endswith("_norm.weight"):
        return gguf.GGMLQuantizationType.F32
    forced = family.forced_type(folder_name)
    if forced is not None:
        return forced
    if name == gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_POS] + ".weight" or not name.endswith(".weight"):
        return gguf.GGMLQuantizationType.F32
    return wanted


def convert_projector(path: str | os.PathLike, out: str | os.PathLike) -> Path | None:
    """Write the projector GGUF of the vision model folder at `path` to `out`; None (nothing written) for a text-only model."""
    folder = HFFolder.open(path)
    family = check_projector(folder)
    if family is None:
        return None
    file_type, tensor_type = FILE_TYPES.get(folder.first_matrix_dtype(), FILE_TYPES[torch.float32])
    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    for name, tensor in family.tensors():
        target = family.gguf_name(name)
        if tensor.dtype not in (torch.float16, torch.float32):
            tensor = tensor.to(torch.float32)
        qtype = stored_type(family, name, target, tensor.ndim, tensor_type)
        writer.add_tensor(target, gguf.quants.quantize(np.ascontiguousarray(tensor.numpy()), qtype), raw_dtype=qtype)
    writer.add_type(gguf.GGUFType.MMPROJ)
    add_provenance(writer, folder)
    writer.add_file_type(file_type)
    family.add_parameters(writer)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return write_out(writer, out)
