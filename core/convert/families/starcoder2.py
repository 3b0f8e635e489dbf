"""StarCoder 2: the common keys and gguf's names are all it needs."""

from __future__ import annotations

import gguf

from corral.convert.family import TextFamily


class Starcoder2Family(TextFamily):
    arch = gguf.MODEL_ARCH.STARCODER2
