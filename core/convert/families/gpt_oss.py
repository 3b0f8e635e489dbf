"""gpt-oss in float weights."""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import torch

from corral.convert.family import TextFamily
from corral.convert.folder import ConvertError


class GptOssFamily(TextFamily):
    """gpt-oss in float weights: the experts' fused, interleaved gate/up split, their matrices transposed to
    GGUF's order, attention sinks named as weights. Its MXFP4 checkpoints (as released) do not convert yet."""

    arch = gguf.MODEL_ARCH.GPT_OSS

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        writer.add_sliding_window(self.config["sliding_window"])
        writer.add_expert_feed_forward_length(self.config["intermediate_size"])

    def rename(self, name: str) -> str:
        name = super().rename(name)
        return name + ".weight" if "sinks" in name else name

    def regroups(self, name: str) -> bool:
        return "down_proj" in name or "gate_up_proj" in name

    def tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name.endswith(("_blocks", "_scales")):
            raise ConvertError(f"{self.folder.path}: {name} is MXFP4; corral converts such folders of float weights only")
        if "down_proj" in name:
            if name.endswith("_bias"):
                yield name.replace("down_proj_bias", "down_proj.bias"), tensor
            else:
                yield name.replace("down_proj", "down_proj.weight"), tensor.transpose(-1, -2)
        elif "gate_up_proj" in name:
            if name.endswith("_bias"):
                yield name.replace("gate_up_proj_bias", "gate_proj.bias"), tensor[..., ::2]
                yield name.replace("gate_up_proj_bias", "up_proj.bias"), tensor[..., 1::2]
            else:
                fused = tensor.transpose(-1, -2)
                yield name.replace("gate_up_proj", "gate_proj.weight"), fused[:, ::2, :]
                yield name.replace("gate_up_proj", "up_proj.weight"), fused[:, 1::2, :]
        else:
            yield from super().tensors(name, tensor)
