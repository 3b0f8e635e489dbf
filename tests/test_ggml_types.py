"""corral.ggml_types writes out the GGUF type tables so that the routing server need not import the `gguf`
package (and the numpy and sentencepiece it imports): they must stay the package's, and work where the
package's members are expected."""

import gguf

from corral.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, LlamaFileType


def members(enum_class) -> dict[str, int]:
    return {member.name: member.value for member in enum_class}


def test_the_enums_are_the_gguf_packages():
    assert members(GGUFValueType) == members(gguf.GGUFValueType)
    assert members(GGMLQuantizationType) == members(gguf.GGMLQuantizationType)
    assert members(LlamaFileType) == members(gguf.LlamaFileType)


def test_the_block_sizes_are_the_gguf_packages():
    assert {qtype.name: size for qtype, size in GGML_QUANT_SIZES.items()} == {
        qtype.name: size for qtype, size in gguf.GGML_QUANT_SIZES.items()
    }


def test_a_type_from_here_finds_and_equals_the_packages_member():
    """Backends key dicts by the package's members and compare with them; corral.gguf hands out these."""
    by_package_type = {qtype: qtype.name for qtype in gguf.GGMLQuantizationType}
    for qtype in GGMLQuantizationType:
        package_type = gguf.GGMLQuantizationType[qtype.name]
        assert qtype == package_type and hash(qtype) == hash(package_type)
        assert by_package_type[qtype] == qtype.name
        assert gguf.GGML_QUANT_SIZES[qtype] == GGML_QUANT_SIZES[package_type]
        assert qtype in {package_type} and str(qtype) == str(package_type)
