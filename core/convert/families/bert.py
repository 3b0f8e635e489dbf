"""BERT encoders (sentence-transformers' all-MiniLM, bge)."""

from __future__ import annotations

import gguf

from corral.convert.family import TextFamily, add_pooling


class BertFamily(TextFamily):
    """BERT encoders (sentence-transformers' MiniLM, bge): not causal, token types, the pooling of modules.json."""

    arch = gguf.MODEL_ARCH.BERT

    def add_parameters(self, writer: gguf.GGUFWriter) -> None:
        super().add_parameters(writer)
        writer.add_causal_attention(False)
        add_pooling(writer, self.folder)

    def skip(self, name: str) -> bool:
        name = self.rename(name)
        return (
            super().skip(name)
            or name in ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")
            or name.startswith(("cls.predictions", "cls.seq_relationship"))
        )

    def rename(self, name: str) -> str:
        name = name.removeprefix("bert.")
        if name.endswith(".gamma"):
            name = name.removesuffix(".gamma") + ".weight"
        if name.endswith(".beta"):
            name = name.removesuffix(".beta") + ".bias"
        return name
