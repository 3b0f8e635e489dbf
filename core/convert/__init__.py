"""Hugging Face safetensors folders to GGUF, written with gguf-py (`FROM ./dir` in a Modelfile)."""

from corral.convert.architectures import FAMILIES
from corral.convert.folder import ConvertError, HFFolder
from corral.convert.writer import check_folder, convert_folder

__all__ = ["FAMILIES", "ConvertError", "HFFolder", "check_folder", "convert_folder"]
