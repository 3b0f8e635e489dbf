"""The GGUF parser under forged files (issue 16): hypothesis mutates a valid tiny model's header (counts,
lengths, dimensions, types and offsets set to their limits; bytes overwritten; the file cut short) and every
outcome is a parsed file or a typed GGUF error, within a bounded allocation; create's checks on what
parsed raise only CreateModelError. No real model is needed."""

import struct
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_gguf import write_tiny_llama

from corral import gguf as corral_gguf
from corral.errors import GGUFError, TruncatedGGUFError
from corral.gguf import GGUFFile
from corral.modelfile import ModelSpec
from corral.modelfile.create import CreateModelError, check_spec
from corral.store import Store

MAX_PEAK_BYTES = 32 << 20  # the tiny file is ~100 kB; nothing a forged header says may cost more than this
_LIMITS = {
    "<Q": [0, 1, 2, 8, 255, 2**31 - 1, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1],
    "<I": [0, 1, 2, 8, 9, 12, 13, 31, 2**16, 2**31 - 1, 2**32 - 1],
}


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> bytes:
    path = write_tiny_llama(tmp_path_factory.mktemp("fuzz") / "tiny.gguf")
    return open(path, "rb").read()


@pytest.fixture(scope="module")
def fields(valid, tmp_path_factory) -> list[tuple[int, str]]:
    """Where each fixed-size header field of the valid file is, and its format: counts, string and array
    lengths, value and tensor types, dimensions and offsets (recorded while the real parser reads it)."""
    seen: list[tuple[int, str]] = []
    take = corral_gguf._Cursor.take
    string = corral_gguf._Cursor.string

    def recording_take(self, fmt):
        if fmt in _LIMITS:
            seen.append((self.pos, fmt))
        return take(self, fmt)

    def recording_string(self):
        seen.append((self.pos, "<Q"))  # the length in front of every string
        return string(self)

    path = tmp_path_factory.mktemp("fields") / "tiny.gguf"
    path.write_bytes(valid)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(corral_gguf._Cursor, "take", recording_take)
        patch.setattr(corral_gguf._Cursor, "string", recording_string)
        GGUFFile.open(path).close()
    return seen


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("mutated")
    return root / "mutated.gguf", Store(root / "store")


def _mutations(fields, size):
    at_limit = st.sampled_from(fields).flatmap(lambda f: st.tuples(st.just("field"), st.just(f), st.sampled_from(_LIMITS[f[1]])))
    header_end = max(pos for pos, _ in fields) + 8
    overwrite = st.tuples(st.just("bytes"), st.integers(0, header_end), st.binary(min_size=1, max_size=8))
    cut = st.tuples(st.just("cut"), st.integers(0, size - 1), st.none())
    return st.lists(at_limit | overwrite | cut, min_size=1, max_size=3)


def mutate(data: bytes, mutations) -> bytes:
    out = bytearray(data)
    for kind, where, value in mutations:
        if kind == "field":
            (pos, fmt) = where
            out[pos:pos + struct.calcsize(fmt)] = struct.pack(fmt, value)
        elif kind == "bytes":
            out[where:where + len(value)] = value
        else:
            del out[where:]
    return bytes(out)


@pytest.mark.slow  # hundreds of hypothesis examples
def test_mutated_headers_fail_only_with_typed_errors_and_bounded_memory(valid, fields, scratch):
    path, store = scratch

    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(mutations=_mutations(fields, len(valid)))
    def check(mutations):
        path.write_bytes(mutate(valid, mutations))
        tracemalloc.start()
        try:
            GGUFFile.open(path).close()
        except GGUFError:
            return
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            assert peak < MAX_PEAK_BYTES, (mutations, peak)
        try:
            check_spec(store, ModelSpec(gguf_path=path))  # what create checks of what parsed: binding, shapes, tokenizer
        except CreateModelError:
            pass

    check()


def _header(kv: bytes, kv_count: int = 1, tensor_count: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensor_count, kv_count) + kv


def _key(name: bytes) -> bytes:
    return struct.pack("<Q", len(name)) + name


@pytest.mark.parametrize(
    "data",
    [
        _header(b"", kv_count=2**64 - 1),  # a forged key-value count
        _header(b"", kv_count=0, tensor_count=2**63),  # a forged tensor count
        _header(_key(b"a") + struct.pack("<IIQ", 9, 6, 2**62)),  # an array of 2^62 uint32
        _header(_key(b"a") + struct.pack("<IIQ", 9, 8, 2**61)),  # an array of 2^61 strings
        _header(struct.pack("<Q", 2**64 - 1)),  # a key 2^64-1 bytes long
    ],
    ids=["kv-count", "tensor-count", "numeric-array", "string-array", "key-length"],
)
def test_forged_counts_are_truncation_errors_at_once(tmp_path, data):
    path = tmp_path / "forged.gguf"
    path.write_bytes(data)
    with pytest.raises(TruncatedGGUFError):
        GGUFFile.open(path)


def test_deeply_nested_arrays_are_refused_not_a_stack_overflow(tmp_path):
    nested = b"".join(struct.pack("<IIQ", 9, 9, 1)[4:] if i else struct.pack("<IIQ", 9, 9, 1) for i in range(5000))
    path = tmp_path / "nested.gguf"
    path.write_bytes(_header(_key(b"a") + nested))
    with pytest.raises(GGUFError, match="nested deeper"):
        GGUFFile.open(path)


@pytest.mark.parametrize("alignment", [0, 3, -32])
def test_an_impossible_alignment_is_a_gguf_error(tmp_path, alignment):
    path = tmp_path / "aligned.gguf"
    path.write_bytes(_header(_key(b"general.alignment") + struct.pack("<Ii", 5, alignment)))
    with pytest.raises(GGUFError, match="alignment"):
        GGUFFile.open(path)
