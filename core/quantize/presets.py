"""The quantization presets `create --quantize` accepts: llama.cpp's file types, by Ollama's names.

A preset is a file type (`general.file_type`, llama.cpp's `llama_ftype`) and the tensor type most of
its weights get; `mix.py` decides the others. Names are matched case-insensitively, as Ollama does
(`q4_k_m`, `Q4_K_M`); `q4_K` and `q5_K` mean the _M mixes, as in llama-quantize.
"""

from __future__ import annotations

import attrs
from gguf import GGMLQuantizationType as Q
from gguf import LlamaFileType

from corral.errors import CorralError


class UnknownQuantizationError(CorralError):
    """The requested quantization is not one corral makes."""


@attrs.frozen
class Preset:
    """A quantization choice: its display name, file type and the type of its ordinary weights."""

    name: str
    file_type: LlamaFileType
    default_type: Q


PRESETS = {
    preset.name.upper(): preset
    for preset in (
        Preset("Q4_0", LlamaFileType.MOSTLY_Q4_0, Q.Q4_0),
        Preset("Q4_1", LlamaFileType.MOSTLY_Q4_1, Q.Q4_1),
        Preset("Q5_0", LlamaFileType.MOSTLY_Q5_0, Q.Q5_0),
        Preset("Q5_1", LlamaFileType.MOSTLY_Q5_1, Q.Q5_1),
        Preset("Q8_0", LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
        Preset("Q4_K_S", LlamaFileType.MOSTLY_Q4_K_S, Q.Q4_K),
        Preset("Q4_K_M", LlamaFileType.MOSTLY_Q4_K_M, Q.Q4_K),
        Preset("Q5_K_S", LlamaFileType.MOSTLY_Q5_K_S, Q.Q5_K),
        Preset("Q5_K_M", LlamaFileType.MOSTLY_Q5_K_M, Q.Q5_K),
        Preset("Q6_K", LlamaFileType.MOSTLY_Q6_K, Q.Q6_K),
    )
}
ALIASES = {"Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}


def preset(name: str) -> Preset:
    """The preset a user's quantization name means; UnknownQuantizationError lists the valid ones."""
    key = name.strip().upper()
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        valid = ", ".join(_display(p.name) for p in PRESETS.values())
        raise UnknownQuantizationError(f"unsupported quantization type {name!r}: supported types are {valid}")
    return PRESETS[key]


def _display(name: str) -> str:
    """Ollama's spelling: lower-case q, upper-case K and size letter (`q4_K_M`)."""
    return "q" + name[1:]
