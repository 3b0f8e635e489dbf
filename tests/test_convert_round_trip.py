"""The real models round-trip: GGUF -> dequantized safetensors folder -> `create` -> the same logits in fp32.

The folder is what a Hugging Face checkpoint of the model would hold: config.json written from the
GGUF's metadata and every tensor dequantized to float32 under transformers' names, with llama's q/k rows
back in rotate-halves order and Gemma's norms without their +1.

SmolLM2's byte-level BPE tokenizer is rebuilt as a tokenizer.json (vocabulary, merges, its digit-splitting
pre-tokenizer, the control tokens) with a tokenizer_config.json holding the chat template, so its folder
goes through `create` exactly as a downloaded one would (FROM ./dir) and every key, tokenizer included,
comes back equal. Gemma 3's sentencepiece tokenizer.model is not rebuilt (that would mean writing
sentencepiece's protobuf): its conversion reuses the GGUF's own tokenizer keys (convert_folder's
`vocab`), proving the weights and the architecture's keys; test_convert.py proves sentencepiece folders.
"""

from __future__ import annotations

import json
import pathlib

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from corral.convert import convert_folder
from corral.engine import load_model
from corral.gguf import GGUFFile
from corral.modelfile import ModelSpec, create_model
from corral.modelfile.syntax import Modelfile
from corral.plugins.backends.torch.dequantize import dequantize
from corral.store import Store

pytestmark = pytest.mark.real_model  # every test here uses a real model: the fast subset does not even import this module

IDS = [1, 504, 3458, 314, 260, 1134, 30, 2, 17, 8821, 42, 999, 120, 7, 3001, 64]


def reverse_names(arch: gguf.MODEL_ARCH, blocks: int) -> dict[str, str]:
    """GGUF name -> a transformers name that gguf's TensorNameMap maps to it (the `model.` ones)."""
    names: dict[str, str] = {}
    for hf, (_, name) in gguf.get_tensor_name_map(arch, blocks).mapping.items():
        if hf.startswith("model.") or hf == "lm_head":
            names.setdefault(name, hf)
    return names


def rotate_halves_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """ggml's adjacent-pair rows of each head back in transformers' rotate-halves order."""
    pairs = weight.reshape(heads, weight.shape[0] // heads // 2, 2, *weight.shape[1:])
    return pairs.transpose(1, 2).reshape(weight.shape)


def hf_config(fields: dict, arch: str) -> dict:
    """config.json of the model the GGUF metadata describes."""
    get = lambda key: fields[f"{arch}.{key}"]  # noqa: E731
    config = {
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": get("attention.head_count"),
        "num_key_value_heads": get("attention.head_count_kv"),
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base"),
        "vocab_size": len(fields["tokenizer.ggml.tokens"]),
        "torch_dtype": "float32",
    }
    if arch == "llama":
        return {**config, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": True}
    return {
        **config,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "head_dim": get("attention.key_length"),
        "sliding_window": get("attention.sliding_window"),
    }


def dequantized_folder(path: pathlib.Path, folder: pathlib.Path) -> tuple[pathlib.Path, dict]:
    """The GGUF at `path` as a float32 safetensors folder (see the module's docstring); and its metadata.

    Dequantized by corral's torch dequantizer, equal bit for bit to gguf.quants.dequantize and many times faster."""
    source = GGUFFile.open(path)
    fields = source.metadata
    arch = fields["general.architecture"]
    config = hf_config(fields, arch)
    names = reverse_names(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.GEMMA3, config["num_hidden_layers"])
    tensors = {}
    for name, info in source.tensors.items():
        weight = dequantize(torch.from_numpy(source.raw(name).copy()), info.qtype, info.shape[-1]).reshape(info.shape)
        base, suffix = name.rsplit(".", 1)
        if arch == "llama" and base.endswith("attn_q"):
            weight = rotate_halves_rows(weight, config["num_attention_heads"])
        elif arch == "llama" and base.endswith("attn_k"):
            weight = rotate_halves_rows(weight, config["num_key_value_heads"])
        elif arch == "gemma3" and base.endswith("norm"):
            weight = weight - 1.0
        tensors[f"{names[base]}.{suffix}"] = weight.contiguous()
    source.close()
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder, fields


def write_bpe_tokenizer(fields: dict, folder: pathlib.Path) -> None:
    """tokenizer.json and tokenizer_config.json of a GGUF's byte-level BPE vocabulary (SmolLM2's: digits split one by one)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    merges = [tuple(merge.split(" ", 1)) for merge in fields["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    control = [tokens[i] for i, kind in enumerate(types) if kind == gguf.TokenType.CONTROL]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in control])
    tokenizer.save(str(folder / "tokenizer.json"))
    named = {role: tokens[fields[f"tokenizer.ggml.{key}_token_id"]] for role, key in
             (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding"))}
    config = {"add_prefix_space": False, "chat_template": fields["tokenizer.chat_template"], **named}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def tokenizer_keys_of(fields: dict):
    """A `vocab` writer for convert_folder: the original GGUF's tokenizer.* keys, in the types llama.cpp writes."""

    def write(writer: gguf.GGUFWriter, folder) -> None:
        for key, value in fields.items():
            if not key.startswith("tokenizer."):
                continue
            if isinstance(value, bool):
                writer.add_bool(key, value)
            elif isinstance(value, int):
                writer.add_uint32(key, value)  # token ids
            elif isinstance(value, str):
                writer.add_string(key, value)
            else:
                writer.add_array(key, value)  # tokens, merges (strings), types (int32), scores (float32)

    return write


def metadata(path: pathlib.Path) -> dict:
    """A GGUF's keys but the provenance (general.*, which a folder's model card would set)."""
    gguf_file = GGUFFile.open(path)
    try:
        return {key: value for key, value in gguf_file.metadata.items() if not key.startswith("general.")}
    finally:
        gguf_file.close()


# The model fixture is looked up by name at run time, so collection cannot see it: marked by hand.
@pytest.mark.real_model
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_real_model_round_trips_through_a_safetensors_folder(which, request, tmp_path, load_once):
    original = request.getfixturevalue(f"{which}_path")
    folder, fields = dequantized_folder(original, tmp_path / which)
    store = Store(tmp_path / "models")
    if fields["tokenizer.ggml.model"] == "gpt2":
        write_bpe_tokenizer(fields, folder)
        spec = ModelSpec.from_modelfile(Modelfile.parse(f"FROM ./{which}\n"), tmp_path)
    else:
        spec = ModelSpec(gguf_path=convert_folder(folder, tmp_path / "converted.gguf", vocab=tokenizer_keys_of(fields)))
    manifest = create_model(store, f"{which}-round-trip", spec)
    assert metadata(store.blob_path(manifest.model.digest)) == metadata(original)
    expected = load_once(original, "fp32").logits(IDS)
    got = load_model(store.blob_path(manifest.model.digest), precision="fp32").logits(IDS)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
