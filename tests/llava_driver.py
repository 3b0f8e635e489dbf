"""Build a tiny LLaVA (LlavaForConditionalGeneration: CLIP ViT, MLP projector, llama text model) with
transformers and convert it with llama.cpp's tools.

    python tests/llava_driver.py LLAMA_CPP_DIR OUT_DIR

Writes, under OUT_DIR/llava/: `hf/` (the model saved with `save_pretrained`, its tokenizer and CLIP
image processor), `image.png`, `reference.npz` (the processor's `pixel_values`, the projector's
`image_features`, the prompt `ids` and transformers' float32 `logits`), `model.gguf` (the text
model, by `convert_hf_to_gguf.py`) and `mmproj.gguf` (by llama.cpp's LLaVA image-encoder converter,
`tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py`: `convert_hf_to_gguf.py --mmproj` takes
only Pixtral towers for this class); or `error.txt`.

The image-encoder converter wants the CLIP tower alone and the projector as a torch file, what its
`llava_surgery*.py` scripts cut from the original LLaVA checkpoints: `split_vision` does that for
the transformers layout. It stores convolution and projector matrices as float16, so those weights
are made float16-representable before the reference runs (the file then holds exactly its weights).
"""

from __future__ import annotations

import json
import pathlib
import runpy
import sys
import traceback

NAME = "llava"
VOCAB_SIZE = 384
IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32
PATCH_SIZE = 4  # 8 x 8 patches, one image token each (the CLS state is dropped)
TOKENS_PER_IMAGE = 64


def write_tokenizer(folder: pathlib.Path) -> dict[str, int]:
    """The tiny byte-level BPE tokenizer with LLaVA's `<image>` token as its last id."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    from reference_models import SPECIAL, write_bpe_tokenizer

    ids = write_bpe_tokenizer(folder, VOCAB_SIZE - 1)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=SPECIAL, eos_token=SPECIAL).save_pretrained(folder)
    image = tokenizer.token_to_id(IMAGE_TOKEN)
    assert image == VOCAB_SIZE - 1
    return {**ids, "image_token_index": image}


def build(folder: pathlib.Path):
    """The tiny LlavaForConditionalGeneration, seeded, float32, saved with its tokenizer and image processor."""
    import torch
    import transformers

    from convert_driver import SEED, perturb
    from reference_models import TINY

    folder.mkdir()
    ids = write_tokenizer(folder)
    text = {**TINY, "model_type": "llama"}
    text.update(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
    vision = dict(
        model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, hidden_act="quick_gelu", projection_dim=16,
    )
    config = transformers.LlavaConfig(
        text_config=text, vision_config=vision, image_token_index=ids["image_token_index"], projector_hidden_act="gelu",
        vision_feature_layer=-2, vision_feature_select_strategy="default", image_seq_length=TOKENS_PER_IMAGE, attn_implementation="eager",
    )
    torch.manual_seed(SEED)
    model = transformers.LlavaForConditionalGeneration(config).to(torch.float32).eval()
    perturb(model)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "patch_embedding" in name or ("multi_modal_projector" in name and tensor.ndim == 2):
                tensor.copy_(tensor.half().float())
    model.save_pretrained(folder)
    processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor.save_pretrained(folder)
    return model, processor, ids


def split_vision(model, folder: pathlib.Path) -> pathlib.Path:
    """The CLIP tower as its own CLIPVisionModel folder and the projector's weights as `llava.projector`."""
    import torch

    folder.mkdir()
    model.model.vision_tower.save_pretrained(folder)
    projector = {f"multi_modal_projector.{name}": t.detach().clone() for name, t in model.model.multi_modal_projector.state_dict().items()}
    torch.save(projector, folder / "llava.projector")
    return folder


def prompt_ids(ids: dict[str, int]) -> list[int]:
    """BOS, text, the image's tokens, text: the layout LLaVA's processor writes for `... <image>\n...`."""
    return [ids["bos_token_id"], 40, 71, 90, 12, *[ids["image_token_index"]] * TOKENS_PER_IMAGE, 55, 66, 77, 200, 150]


def reference(model, processor, ids: dict[str, int], image) -> dict:
    """The processor's pixels, the projector's features and transformers' logits with the image."""
    import numpy as np
    import torch

    pixel_values = processor(images=[image], return_tensors="pt")["pixel_values"]
    tokens = prompt_ids(ids)
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values=pixel_values, vision_feature_layer=-2, vision_feature_select_strategy="default")
        features = getattr(features, "pooler_output", features)
        features = features[0] if isinstance(features, (list, tuple)) else features[0]
        logits = model(input_ids=torch.tensor([tokens]), pixel_values=pixel_values, use_cache=False).logits[0]
    return dict(pixel_values=pixel_values[0].numpy(), image_features=features.numpy(), ids=np.array(tokens), logits=logits.float().numpy())


def convert_projector(llama_cpp: pathlib.Path, tower: pathlib.Path, out: pathlib.Path) -> None:
    """llama.cpp's LLaVA image-encoder converter on the split tower, into `out`."""
    script = llama_cpp / "tools" / "mtmd" / "legacy-models" / "convert_image_encoder_to_gguf.py"
    import torch
    import transformers

    class NestedTower(torch.nn.Module):
        """transformers 5's CLIPVisionModel is flat; the converter reads the `vision_model.*` layout of earlier releases."""

        def __init__(self, tower):
            super().__init__()
            self.vision_model = tower

        @classmethod
        def from_pretrained(cls, path):
            return cls(flat.from_pretrained(path))

    flat = transformers.CLIPVisionModel
    argv, transformers.CLIPVisionModel = sys.argv, NestedTower
    sys.argv = [str(script), "-m", str(tower), "--llava-projector", str(tower / "llava.projector"), "--output-dir", str(tower),
                "--clip-model-is-vision", "--use-f32"]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, transformers.CLIPVisionModel = argv, flat
    (tower / "mmproj-model-f32.gguf").rename(out)


def main(llama_cpp: str, out_dir: str) -> None:
    import logging

    import numpy as np

    from convert_driver import import_converter
    from vision_driver import convert, test_image

    logging.basicConfig(level=logging.WARNING)
    llama_cpp_dir = pathlib.Path(llama_cpp).resolve()
    converter = import_converter(llama_cpp_dir)
    target = pathlib.Path(out_dir) / NAME
    target.mkdir(parents=True)
    try:
        model, processor, ids = build(target / "hf")
        image = test_image()
        image.save(target / "image.png")
        np.savez(target / "reference.npz", **reference(model, processor, ids, image))
        (target / "ids.json").write_text(json.dumps(ids))
        convert(converter, target / "hf", target / "model.gguf")
        convert_projector(llama_cpp_dir, split_vision(model, target / "tower"), target / "mmproj.gguf")
    except (Exception, SystemExit):
        (target / "error.txt").write_text(traceback.format_exc())
        print(f"{NAME}: failed, see {target / 'error.txt'}", file=sys.stderr)


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    main(*sys.argv[1:])
