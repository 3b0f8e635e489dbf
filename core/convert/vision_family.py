"""What every vision tower's conversion shares (corral.convert.projector writes the file): the folder's
`vision_config`, its image processor's settings, the tensors of the vision side, and the hooks a
family fills in: names, types, keys. Learnt from llama.cpp's converters (read, not copied)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gguf
import torch

from corral.convert.family import VISION_PREFIXES
from corral.convert.folder import ConvertError, HFFolder
from corral.convert.writer import FILE_TYPES

# The processor files whose image settings (mean, std, tokens per image) a projector's keys take, in llama.cpp's
# order: the later one's values win; each may nest them under the second name.
PROCESSOR_FILES = (("preprocessor_config.json", "media_proc_cfg"), ("processor_config.json", "image_processor"))
F32, F16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16


class VisionFamily:
    """A vision tower and its projector: which folder tensors they are, their GGUF names and types, the file's keys."""

    prefixes: tuple[str, ...] = VISION_PREFIXES  # the folder tensors that belong to the vision side

    def __init__(self, folder: HFFolder):
        self.folder = folder
        vision = folder.config.get("vision_config")
        if not isinstance(vision, dict):
            raise ConvertError(f"config.json in {folder.path} has no vision_config: the vision tower cannot be converted")
        self.vision = vision
        self.processor = processor_settings(folder)
        self.blocks = self.tower_blocks()

    def setting(self, key: str, default: Any = None) -> Any:
        """A vision_config value; a ConvertError naming it when it is missing and has no default."""
        value = self.vision.get(key, default)
        if value is None:
            raise ConvertError(f"config.json in {self.folder.path} says nothing of the vision tower's {key} (vision_config)")
        return value

    def tower_blocks(self) -> int:
        """How many of the tower's blocks the file holds."""
        return self.setting("num_hidden_layers")

    def image_setting(self, key: str) -> Any:
        if key not in self.processor:
            raise ConvertError(f"{self.folder.path} has no image processor {key} (preprocessor_config.json): images could not be prepared")
        return self.processor[key]

    def rename(self, name: str) -> str | None:
        """A folder tensor's name as `gguf_name` reads it; None for one the file leaves out."""
        return name.removeprefix("model.")

    def modify(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gguf_name(self, name: str) -> str:
        raise NotImplementedError

    def file_type(self) -> tuple[gguf.LlamaFileType, gguf.GGMLQuantizationType]:
        """The file's type and its matrices' type, from the folder's (F32 stays F32)."""
        return FILE_TYPES.get(self.folder.first_matrix_dtype(), FILE_TYPES[torch.float32])

    def stored_type(self, folder_name: str, name: str, dims: int, wanted: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
        """The type of one tensor: `wanted` is the file's matrix type."""
        raise NotImplementedError

    def add_metadata(self, writer: gguf.GGUFWriter, file_type: gguf.LlamaFileType) -> None:
        """Every key of the file but general.architecture (written once the tensors are in, for the parameter count)."""
        raise NotImplementedError

    def names(self) -> list[str]:
        """The (renamed) folder tensors the file holds, without reading one."""
        return [renamed for name in self.folder.weights if name.startswith(self.prefixes) and (renamed := self.rename(name)) is not None]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The vision side's (renamed, modified) folder tensors, read one at a time."""
        for name, tensor in self.folder.tensors():
            if name.startswith(self.prefixes) and (renamed := self.rename(name)) is not None:
                yield renamed, self.modify(renamed, tensor)


def processor_settings(folder: HFFolder) -> dict[str, Any]:
    """The image processor's settings, from preprocessor_config.json and processor_config.json merged."""
    settings: dict[str, Any] = {}
    for file, nested in PROCESSOR_FILES:
        found = folder.json(file)
        if isinstance(found, dict):
            settings |= found | (found[nested] if isinstance(found.get(nested), dict) else {})
    return settings
