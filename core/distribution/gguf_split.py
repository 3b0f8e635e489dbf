"""Merge a split GGUF (`name-00001-of-0000N.gguf`, llama.cpp's gguf-split layout) into one GGUF file.

The first part holds the model's metadata and `split.count`; every part holds `split.no` and some of
the tensors, `split.tensors.count` in all. The merged file keeps the first part's metadata without the
`split.*` keys and lists every tensor in part order, so it is the file `llama-gguf-split --merge`
would write and loads like any single GGUF. gguf-py reads the parts and writes the header.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import gguf

from corral.errors import GGUFError

SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def merge_split(parts: Sequence[str | os.PathLike], out: str | os.PathLike, on_tensor: Callable[[int], None] | None = None) -> None:
    """Write the parts of a split GGUF, in order, as one GGUF file at `out`; `on_tensor(bytes)` after each tensor."""
    readers = [gguf.GGUFReader(os.fspath(part)) for part in parts]
    _check_parts(readers, [Path(part).name for part in parts])
    first = readers[0]
    writer = gguf.GGUFWriter(os.fspath(out), _string(first, "general.architecture"))
    alignment = first.fields.get("general.alignment")
    if alignment is not None:
        writer.data_alignment = int(alignment.contents())
    for key, field in first.fields.items():
        if key.startswith("GGUF.") or key in SPLIT_KEYS or key == "general.architecture":
            continue  # the reader's own header fields, the split bookkeeping, and what the writer adds itself
        main = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if main == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), main, sub)
    tensors = [tensor for reader in readers for tensor in reader.tensors]
    for tensor in tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, int(tensor.n_bytes), tensor.tensor_type)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor in tensors:
            writer.write_tensor_data(tensor.data)
            if on_tensor:
                on_tensor(int(tensor.n_bytes))
    finally:
        writer.close()


def _check_parts(readers: list[gguf.GGUFReader], names: list[str]) -> None:
    """Each part says it is part i of len(parts), and the parts hold the tensor count the first announces."""
    for number, (reader, name) in enumerate(zip(readers, names, strict=True)):
        count, index = _int(reader, "split.count", name), _int(reader, "split.no", name)
        if count != len(readers) or index != number:
            raise GGUFError(f"{name} says it is part {index + 1} of {count}, expected part {number + 1} of {len(readers)}")
    expected = _int(readers[0], "split.tensors.count", names[0])
    found = sum(len(reader.tensors) for reader in readers)
    if found != expected:
        raise GGUFError(f"the split parts hold {found} tensors, the first part announces {expected}")


def _int(reader: gguf.GGUFReader, key: str, name: str) -> int:
    field = reader.fields.get(key)
    if field is None:
        raise GGUFError(f"{name} is not part of a split GGUF: metadata key '{key}' is missing")
    return int(field.contents())


def _string(reader: gguf.GGUFReader, key: str) -> str:
    field = reader.fields.get(key)
    if field is None:
        raise GGUFError(f"the first split part has no '{key}'")
    return str(field.contents())
