"""The GGUF format's type tables: metadata value types, tensor (quantization) types and their block sizes,
file types.

Written out here rather than imported from the `gguf` package because importing `gguf` at all runs its
`__init__`, which imports numpy and sentencepiece (~22 MiB of the routing server's RSS, BENCHMARKS.md
"Server RSS holding 500 open streams"); the server needs only these numbers to read a file's header.
They are the format's, so they cannot change for a published type; tests/test_ggml_types.py asserts
that they equal the `gguf` package's, so a type added there shows up as a failing test here.

The enums are IntEnums like the package's: a member equals and hashes as its value, so a
`GGMLQuantizationType.Q4_K` from here finds `gguf.GGMLQuantizationType.Q4_K`'s entry in a dict keyed by
the package's members, and compares equal to it (the backends, which import `gguf`, rely on that).
"""

from __future__ import annotations

import enum


class GGUFValueType(enum.IntEnum):
    """The type tag of a metadata value."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


class GGMLQuantizationType(enum.IntEnum):
    """The type of a tensor's data (a float type or a block quantization)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


_Q = GGMLQuantizationType

# (values in a block, bytes a block takes) for each tensor type.
GGML_QUANT_SIZES: dict[GGMLQuantizationType, tuple[int, int]] = {
    _Q.F32: (1, 4), _Q.F16: (1, 2), _Q.BF16: (1, 2), _Q.F64: (1, 8),
    _Q.I8: (1, 1), _Q.I16: (1, 2), _Q.I32: (1, 4), _Q.I64: (1, 8),
    _Q.Q4_0: (32, 18), _Q.Q4_1: (32, 20), _Q.Q5_0: (32, 22), _Q.Q5_1: (32, 24), _Q.Q8_0: (32, 34), _Q.Q8_1: (32, 40),
    _Q.Q2_K: (256, 84), _Q.Q3_K: (256, 110), _Q.Q4_K: (256, 144), _Q.Q5_K: (256, 176), _Q.Q6_K: (256, 210),
    _Q.Q8_K: (256, 292),
    _Q.IQ2_XXS: (256, 66), _Q.IQ2_XS: (256, 74), _Q.IQ2_S: (256, 82), _Q.IQ3_XXS: (256, 98), _Q.IQ3_S: (256, 110),
    _Q.IQ1_S: (256, 50), _Q.IQ1_M: (256, 56), _Q.IQ4_NL: (32, 18), _Q.IQ4_XS: (256, 136),
    _Q.TQ1_0: (256, 54), _Q.TQ2_0: (256, 66), _Q.MXFP4: (32, 17), _Q.NVFP4: (64, 36), _Q.Q1_0: (128, 18),
}


class LlamaFileType(enum.IntEnum):
    """`general.file_type`: the quantization a file was made with, as llama.cpp's quantize names it."""

    ALL_F32 = 0
    MOSTLY_F16 = 1
    MOSTLY_Q4_0 = 2
    MOSTLY_Q4_1 = 3
    MOSTLY_Q8_0 = 7
    MOSTLY_Q5_0 = 8
    MOSTLY_Q5_1 = 9
    MOSTLY_Q2_K = 10
    MOSTLY_Q3_K_S = 11
    MOSTLY_Q3_K_M = 12
    MOSTLY_Q3_K_L = 13
    MOSTLY_Q4_K_S = 14
    MOSTLY_Q4_K_M = 15
    MOSTLY_Q5_K_S = 16
    MOSTLY_Q5_K_M = 17
    MOSTLY_Q6_K = 18
    MOSTLY_IQ2_XXS = 19
    MOSTLY_IQ2_XS = 20
    MOSTLY_Q2_K_S = 21
    MOSTLY_IQ3_XS = 22
    MOSTLY_IQ3_XXS = 23
    MOSTLY_IQ1_S = 24
    MOSTLY_IQ4_NL = 25
    MOSTLY_IQ3_S = 26
    MOSTLY_IQ3_M = 27
    MOSTLY_IQ2_S = 28
    MOSTLY_IQ2_M = 29
    MOSTLY_IQ4_XS = 30
    MOSTLY_IQ1_M = 31
    MOSTLY_BF16 = 32
    MOSTLY_TQ1_0 = 36
    MOSTLY_TQ2_0 = 37
    MOSTLY_MXFP4_MOE = 38
    MOSTLY_NVFP4 = 39
    MOSTLY_Q1_0 = 40
    GUESSED = 1024
