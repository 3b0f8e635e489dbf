"""Vision towers: Gemma 3's (llama.cpp's `convert_hf_to_gguf.py --mmproj` layout) and LLaVA 1.5's (the layout of
llama.cpp's LLaVA image-encoder converter, the one `--mmproj` does not write for this class)."""

from __future__ import annotations

import re

import gguf
import torch

from corral.convert.folder import ConvertError, HFFolder
from corral.convert.vision_family import F16, F32, VisionFamily
from corral.convert.writer import add_provenance


class Gemma3VisionFamily(VisionFamily):
    """Gemma 3: SigLIP (without its pooling head), then the soft-embedding RMSNorm (its +1 folded in) and the input
    projection; gguf's MMPROJ tensor names, projector type "gemma3". Types as llama.cpp chooses them for this tower:
    the patch and position embeddings F32, the input projection F16 (for ggml's matmul), vectors and norms F32."""

    DEFAULT_MERGE = 4  # what llama.cpp assumes when the file names no scale factor (every released size)

    def __init__(self, folder: HFFolder):
        super().__init__(folder)
        self.tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, self.blocks)

    def rename(self, name: str) -> str | None:
        name = super().rename(name)
        if ".head." in name:
            return None  # SigLIP's pooling head: Gemma 3 reads the patch states
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            # transformers 5 saves the tower flat; released checkpoints (and gguf's map) nest it
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        return name.replace("_weight", ".weight")  # multi_modal_projector.mm_input_projection_weight is a bare parameter

    def modify(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + 1.0 if "soft_emb_norm.weight" in name else tensor  # Gemma3RMSNorm multiplies by (1 + weight)

    def gguf_name(self, name: str) -> str:
        mapped = self.tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ConvertError(f"{self.folder.path}: vision tensor {name} has no GGUF name in a projector")
        return mapped

    def stored_type(self, folder_name: str, name: str, dims: int, wanted: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
        if dims <= 1 or name.endswith("_norm.weight"):
            return F32
        if "input_projection" in folder_name:
            return F16
        if ".embeddings." in folder_name or not name.endswith(".weight"):
            return F32
        return wanted

    def add_metadata(self, writer: gguf.GGUFWriter, file_type: gguf.LlamaFileType) -> None:
        writer.add_type(gguf.GGUFType.MMPROJ)
        add_provenance(writer, self.folder)
        writer.add_file_type(file_type)
        writer.add_clip_has_vision_encoder(True)
        text_width = self.folder.config.get("hidden_size")
        if text_width is None:
            raise ConvertError(f"config.json in {self.folder.path} says nothing of the text model's hidden_size")
        writer.add_vision_projection_dim(text_width)
        writer.add_vision_image_size(self.setting("image_size"))
        writer.add_vision_patch_size(self.setting("patch_size"))
        writer.add_vision_embedding_length(self.setting("hidden_size"))
        writer.add_vision_feed_forward_length(self.setting("intermediate_size"))
        writer.add_vision_block_count(self.blocks)
        writer.add_vision_head_count(self.setting("num_attention_heads"))
        writer.add_vision_image_mean(self.image_setting("image_mean"))
        writer.add_vision_image_std(self.image_setting("image_std"))
        writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
        writer.add_vision_attention_layernorm_eps(self.vision.get("layer_norm_eps", 1e-6))
        writer.add_vision_use_gelu(True)
        per_side = int(self.processor.get("image_seq_length", 256) ** 0.5)  # tokens per image, a square of them
        merge = (self.setting("image_size") // self.setting("patch_size")) // per_side
        if merge > 0 and merge != self.DEFAULT_MERGE:
            writer.add_vision_projector_scale_factor(merge)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


class LlavaVisionFamily(VisionFamily):
    """LLaVA 1.5: a CLIP ViT read at `vision_feature_layer` (the file holds the blocks up to it, without CLIP's final
    norm), the class row dropped ("default" selection), a two-layer GELU MLP. Written as llama.cpp's LLaVA image-encoder
    converter writes it from the split tower (projector type "mlp", CLIP's fc1 under `ffn_down` and fc2 under
    `ffn_up`): the file corral's LLaVA encoder and Ollama's llava projectors read. Its types: convolution and
    projector matrices F16, vectors F32, the tower's matrices F32 or, from a 16-bit folder, F16."""

    BLOCK = re.compile(r"encoder\.layers\.(?P<block>\d+)\.(?P<part>.+)\.(?P<kind>weight|bias)")
    BLOCK_PARTS = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_out",
        "layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_down", "mlp.fc2": "ffn_up",
    }  # fmt: skip
    EMBEDDINGS = {
        "embeddings.class_embedding": "v.class_embd", "embeddings.patch_embedding.weight": "v.patch_embd.weight",
        "embeddings.position_embedding.weight": "v.position_embd.weight", "pre_layrnorm.weight": "v.pre_ln.weight",
        "pre_layrnorm.bias": "v.pre_ln.bias",
    }  # fmt: skip
    PROJECTOR = {"linear_1": "mm.0", "linear_2": "mm.2"}

    def __init__(self, folder: HFFolder):
        super().__init__(folder)
        config = folder.config
        for key, wanted in (("vision_feature_select_strategy", "default"), ("projector_hidden_act", "gelu"), ("multimodal_projector_bias", True)):
            if config.get(key, wanted) != wanted:
                raise ConvertError(f"{folder.path}: a LLaVA with {key} {config[key]!r} does not convert (corral's LLaVA encoder needs {wanted!r})")

    def tower_blocks(self) -> int:
        """The blocks up to `vision_feature_layer` (an index into the hidden states: -2 is all blocks but the last)."""
        layers, layer = self.setting("num_hidden_layers"), self.folder.config.get("vision_feature_layer", -2)
        blocks = layer if isinstance(layer, int) and layer >= 0 else layers + layer + 1 if isinstance(layer, int) else 0
        if not 1 <= blocks <= layers:
            raise ConvertError(f"{self.folder.path}: vision_feature_layer {layer!r} does not convert (one layer of the {layers}-block tower)")
        return blocks

    def rename(self, name: str) -> str | None:
        name = super().rename(name)
        if name.startswith("vision_tower."):
            inner = name.removeprefix("vision_tower.").removeprefix("vision_model.")
            block = self.BLOCK.fullmatch(inner)
            if inner.startswith("post_layernorm.") or (block is not None and int(block["block"]) >= self.blocks):
                return None  # what LLaVA does not read: CLIP's final norm, the blocks past the feature layer
            return "vision_tower." + inner
        return name

    def gguf_name(self, name: str) -> str:
        inner = name.removeprefix("vision_tower.")
        if name.startswith("multi_modal_projector."):
            layer, _, kind = name.removeprefix("multi_modal_projector.").partition(".")
            mapped = f"{self.PROJECTOR[layer]}.{kind}" if layer in self.PROJECTOR else None
        elif (block := self.BLOCK.fullmatch(inner)) is not None:
            part = self.BLOCK_PARTS.get(block["part"])
            mapped = part and f"v.blk.{block['block']}.{part}.{block['kind']}"
        else:
            mapped = self.EMBEDDINGS.get(inner)
        if mapped is None:
            raise ConvertError(f"{self.folder.path}: vision tensor {name} has no GGUF name in a LLaVA projector")
        return mapped

    def file_type(self) -> tuple[gguf.LlamaFileType, gguf.GGMLQuantizationType]:
        if self.folder.first_matrix_dtype() in (None, torch.float32):
            return gguf.LlamaFileType.ALL_F32, F32
        return gguf.LlamaFileType.MOSTLY_F16, F16  # the converter writes F32 or F16 files, never BF16

    def stored_type(self, folder_name: str, name: str, dims: int, wanted: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
        if dims == 4 or (dims == 2 and (folder_name.startswith("multi_modal_projector.") or (wanted == F16 and name.endswith(".weight")))):
            return F16
        return F32

    def add_metadata(self, writer: gguf.GGUFWriter, file_type: gguf.LlamaFileType) -> None:
        writer.add_bool("clip.has_text_encoder", False)
        writer.add_clip_has_vision_encoder(True)
        writer.add_bool("clip.has_llava_projector", True)
        writer.add_file_type(file_type)
        writer.add_name(self.folder.config.get("_name_or_path") or self.folder.path.name)
        writer.add_description("image encoder for LLaVA")
        writer.add_clip_projector_type("mlp")
        writer.add_vision_image_size(self.setting("image_size"))
        writer.add_vision_patch_size(self.setting("patch_size"))
        writer.add_vision_embedding_length(self.setting("hidden_size"))
        writer.add_vision_feed_forward_length(self.setting("intermediate_size"))
        writer.add_vision_projection_dim(self.setting("projection_dim", 512))  # CLIP's own contrastive width, as the converter writes it
        writer.add_vision_head_count(self.setting("num_attention_heads"))
        writer.add_vision_attention_layernorm_eps(self.setting("layer_norm_eps", 1e-5))
        writer.add_vision_block_count(self.blocks)
        writer.add_vision_image_mean(self.image_setting("image_mean"))
        writer.add_vision_image_std(self.image_setting("image_std"))
        writer.add_vision_use_gelu(self.vision.get("hidden_act") == "gelu")  # else CLIP's QuickGELU
