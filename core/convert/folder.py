"""A Hugging Face model folder as the converter reads it: config.json, the safetensors weights (one file,
or shards listed by model.safetensors.index.json) and the tokenizer's files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import SafetensorError, safe_open

from corral.errors import CorralError

INDEX = "model.safetensors.index.json"


class ConvertError(CorralError):
    """A folder cannot be converted to GGUF: a file is missing or unreadable, or its architecture is unknown."""


@attrs.frozen
class HFFolder:
    """The files of one model folder; tensors are read lazily, one at a time."""

    path: Path
    config: dict[str, Any]
    weights: dict[str, Path]  # tensor name -> the safetensors file holding it, in the files' order

    @classmethod
    def open(cls, path: str | Path) -> HFFolder:
        """Read config.json and index the weights; a missing or broken file is a ConvertError naming it."""
        path = Path(path)
        if not path.is_dir():
            raise ConvertError(f"{path} is not a directory")
        config = read_json(path / "config.json", required=True)
        if "text_config" in config:  # a multimodal wrapper: the language model's settings
            config = {**config, **config["text_config"]}
        return cls(path, config, _index_weights(path))

    def json(self, name: str) -> Any:
        """One of the folder's JSON files ({} when it has none)."""
        return read_json(self.path / name, required=False, object_only=False)

    def has(self, name: str) -> bool:
        return (self.path / name).is_file()

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, in the files' order, each read from its file when it is reached."""
        by_file: dict[Path, list[str]] = {}
        for name, file in self.weights.items():
            by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            with safe_open(file, framework="pt") as weights:
                for name in names:
                    yield name, weights.get_tensor(name)

    def first_matrix_dtype(self) -> torch.dtype | None:
        """The dtype of the first tensor of two or more dimensions (what `--outtype auto` goes by)."""
        for name, file in self.weights.items():
            with safe_open(file, framework="pt") as weights:
                piece = weights.get_slice(name)
                if len(piece.get_shape()) >= 2:
                    return _SAFETENSORS_DTYPES.get(piece.get_dtype())
        return None


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_json(path: Path, *, required: bool, object_only: bool = True) -> Any:
    if not path.is_file():
        if required:
            raise ConvertError(f"{path.parent} has no {path.name}: a Hugging Face model folder needs one")
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConvertError(f"cannot read {path.name} in {path.parent}: {error}") from None
    if object_only and not isinstance(value, dict):
        raise ConvertError(f"{path.name} in {path.parent} is not a JSON object")
    return value


def _index_weights(path: Path) -> dict[str, Path]:
    """Tensor name -> file, from the index of a sharded folder or from the safetensors files themselves."""
    index = read_json(path / INDEX, required=False)
    if index:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConvertError(f"{INDEX} in {path} has no weight_map")
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not (path / name).is_file() or Path(name).name != name]
        if missing:
            raise ConvertError(f"{path} lacks the weight files its {INDEX} lists: {', '.join(missing)}")
    else:
        files = sorted(p.name for p in path.glob("model*.safetensors"))
        if not files:
            raise ConvertError(f"{path} has no model.safetensors (or model-*-of-*.safetensors shards with {INDEX})")
    weights: dict[str, Path] = {}
    for name in files:
        try:
            with safe_open(path / name, framework="pt") as part:
                for key in part.keys():
                    weights[key] = path / name
        except (SafetensorError, OSError) as error:
            raise ConvertError(f"cannot read {name} in {path}: {error}") from None
    if index and set(weights) != set(index["weight_map"]):
        absent = sorted(set(index["weight_map"]) - set(weights))[:5]
        raise ConvertError(f"the weight files in {path} do not hold what {INDEX} lists (e.g. {', '.join(absent)})")
    return weights
