"""Build the tiny Gemma 3 vision model with transformers and convert it with llama.cpp's converter.

    python tests/vision_driver.py LLAMA_CPP_DIR OUT_DIR

Writes, under OUT_DIR/gemma3-vision/: `hf/` (Gemma3ForConditionalGeneration saved with
`save_pretrained`, its tokenizer and image processor), `image.png` (the test image), `reference.npz`
(the processor's `pixel_values`, the projector's `image_features`, the prompt `ids` with their
`token_type_ids`, and transformers' float32 `logits` on them), `model.gguf` (the text model) and
`mmproj.gguf` (`--mmproj`: SigLIP and the projector), both `--outtype f32`; or `error.txt`.

Its own process for the reason convert_driver.py gives (llama.cpp's gguf-py goes first on sys.path).
"""

from __future__ import annotations

import json
import pathlib
import sys
import traceback

NAME = "gemma3-vision"
VOCAB_SIZE = 384
# The image tokens Gemma 3's processor writes, added to the tiny tokenizer under their real names:
# corral finds them by text, as llama.cpp's mtmd does.
IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
IMAGE_SIZE = 32
PATCH_SIZE = 4  # 8 x 8 patches
TOKENS_PER_IMAGE = 16  # pooled 2 x 2: 4 x 4 tokens


def write_tokenizer(folder: pathlib.Path) -> dict[str, int]:
    """The tiny byte-level BPE tokenizer with Gemma 3's three image tokens as its last ids."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    from reference_models import SPECIAL, write_bpe_tokenizer

    ids = write_bpe_tokenizer(folder, VOCAB_SIZE - len(IMAGE_TOKENS))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(text, special=True) for text in IMAGE_TOKENS])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=SPECIAL, eos_token=SPECIAL).save_pretrained(folder)
    boi, eoi, soft = (tokenizer.token_to_id(text) for text in IMAGE_TOKENS)
    assert (boi, eoi, soft) == (VOCAB_SIZE - 3, VOCAB_SIZE - 2, VOCAB_SIZE - 1)
    return {**ids, "boi_token_index": boi, "eoi_token_index": eoi, "image_token_index": soft}


def test_image():
    """A 45 x 37 RGB image with gradients and a square: not square, not the model's size, so resizing shows."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:37, 0:45]
    pixels = np.stack([x * 5, y * 6, (x * y) % 256], axis=-1).astype(np.uint8)
    pixels[10:20, 12:30] = (250, 30, 90)
    return Image.fromarray(pixels, "RGB")


def build(folder: pathlib.Path):
    """The tiny Gemma3ForConditionalGeneration, seeded, float32, saved with its tokenizer and image processor."""
    import torch
    import transformers

    from convert_driver import SEED, perturb
    from reference_models import TINY

    folder.mkdir()
    ids = write_tokenizer(folder)
    text = {**TINY, "num_hidden_layers": 6, "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 8}
    text.update(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
        vision_use_head=False,  # Gemma 3 uses the patch states, not SigLIP's pooling head
    )
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=ids["boi_token_index"],
        eoi_token_index=ids["eoi_token_index"],
        image_token_index=ids["image_token_index"],
        attn_implementation="eager",
    )
    torch.manual_seed(SEED)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():
        # transformers starts the projection at zeros; random, and representable in float16, the type
        # the converter forces it to (so the file holds exactly the reference's weights).
        projection = model.model.multi_modal_projector.mm_input_projection_weight
        projection.copy_((torch.randn(projection.shape) * 0.1).half().float())
    perturb(model)
    model.save_pretrained(folder)
    nest_vision_tower(folder)
    processor = transformers.Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_seq_length=TOKENS_PER_IMAGE)
    processor.save_pretrained(folder)
    return model, processor, ids


def nest_vision_tower(folder: pathlib.Path) -> None:
    """Rename `vision_tower.*` to `vision_tower.vision_model.*` in the saved weights: transformers 5 saves the
    SigLIP tower flat, the released Gemma 3 checkpoints (and so the converter's tensor map) nest it."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    renamed = {("vision_tower.vision_model." + name.removeprefix("vision_tower.") if name.startswith("vision_tower.") else name): t for name, t in tensors.items()}
    save_file(renamed, path, metadata={"format": "pt"})


def prompt_ids(ids: dict[str, int]) -> list[int]:
    """BOS, text, the image (start, soft tokens, end), text: the layout Gemma 3's processor writes."""
    image = [ids["boi_token_index"], *[ids["image_token_index"]] * TOKENS_PER_IMAGE, ids["eoi_token_index"]]
    return [ids["bos_token_id"], 40, 71, 90, 12, *image, 55, 66, 77, 200, 150]


def reference(model, processor, ids: dict[str, int], image) -> dict:
    """The processor's pixels, the projector's features and transformers' logits with the image."""
    import numpy as np
    import torch

    pixel_values = processor(images=[image], return_tensors="pt")["pixel_values"]
    tokens = prompt_ids(ids)
    token_type_ids = [int(t == ids["image_token_index"]) for t in tokens]
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values).pooler_output
        logits = model(
            input_ids=torch.tensor([tokens]), pixel_values=pixel_values, token_type_ids=torch.tensor([token_type_ids]), use_cache=False
        ).logits[0]
    return dict(
        pixel_values=pixel_values[0].numpy(),
        image_features=features[0].numpy(),
        ids=np.array(tokens),
        token_type_ids=np.array(token_type_ids),
        logits=logits.float().numpy(),
    )


def convert(converter, folder: pathlib.Path, out: pathlib.Path, *extra: str) -> None:
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(folder), "--outtype", "f32", "--outfile", str(out), *extra]
    try:
        converter.main()
    finally:
        sys.argv = argv


def main(llama_cpp: str, out_dir: str) -> None:
    import logging

    import numpy as np

    from convert_driver import import_converter

    logging.basicConfig(level=logging.WARNING)
    converter = import_converter(pathlib.Path(llama_cpp).resolve())
    target = pathlib.Path(out_dir) / NAME
    target.mkdir(parents=True)
    try:
        model, processor, ids = build(target / "hf")
        image = test_image()
        image.save(target / "image.png")
        np.savez(target / "reference.npz", **reference(model, processor, ids, image))
        (target / "ids.json").write_text(json.dumps(ids))
        convert(converter, target / "hf", target / "model.gguf")
        convert(converter, target / "hf", target / "mmproj.gguf", "--mmproj")
    except (Exception, SystemExit):
        (target / "error.txt").write_text(traceback.format_exc())
        print(f"{NAME}: failed, see {target / 'error.txt'}", file=sys.stderr)


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    main(*sys.argv[1:])
