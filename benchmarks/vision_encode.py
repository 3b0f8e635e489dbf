"""Encoding cost per image: preprocessing (Pillow) and the vision encoder's graph (corral.vision.ImageEncoder).

    python benchmarks/vision_encode.py [--projector mmproj.gguf | --synthetic-layers N [--shape gemma3|llava] |
        --tiny gemma3-vision|llava] [--rounds 3] [--precision auto] [--threads N]

With `--projector`, that file (a real Gemma 3 mmproj, say). With `--synthetic-layers N`, a projector of a
released shape with only N blocks of random float16 weights, written with gguf.GGUFWriter: the per-block
time times the real block count estimates the full tower. `--shape gemma3` (the default): SigLIP-So400m at
896 px (4096 patches of 1152 features, 16 heads, FFN 4304; 4 x 4 pooling to 256 tokens of 2560).
`--shape llava`: LLaVA-1.5's CLIP ViT-L/14 at 336 px (576 patches and a class row of 1024 features, 16
heads, FFN 4096, 23 of its 24 blocks used) and its MLP projector to 4096. Otherwise the tiny test model of
`--tiny` (tests/vision_driver.py or tests/llava_driver.py; cached under CORRAL_PEERS, built once with
llama.cpp's converters). Each round encodes a new image (the digest cache is bypassed); the figure is the
best round. "encode" is the graph alone, on the pixels preprocessing gave. Prints markdown.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

GEMMA3 = dict(image_size=896, patch_size=14, width=1152, ffn=4304, heads=16, merge=4, projection=2560, blocks=27)
LLAVA = dict(image_size=336, patch_size=14, width=1024, ffn=4096, heads=16, projection=4096, blocks=23)
SHAPES = {"gemma3": GEMMA3, "llava": LLAVA}


def synthetic_projector(path: pathlib.Path, layers: int, shape: str = "gemma3") -> pathlib.Path:
    """A Gemma 3- or LLaVA-1.5-shaped mmproj with `layers` blocks of random float16 weights."""
    import gguf

    g, llava = SHAPES[shape], shape == "llava"
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("clip.projector_type", "mlp" if llava else "gemma3")
    for key, value in (("image_size", g["image_size"]), ("patch_size", g["patch_size"]), ("embedding_length", g["width"]),
                       ("feed_forward_length", g["ffn"]), ("block_count", layers), ("attention.head_count", g["heads"]),
                       ("projection_dim", g["projection"])):  # fmt: skip
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    def add(name: str, *shape: int, dtype=np.float16) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(dtype))

    width, patches = g["width"], (g["image_size"] // g["patch_size"]) ** 2
    add("v.patch_embd.weight", width, 3, g["patch_size"], g["patch_size"], dtype=np.float32)
    if llava:  # CLIP: no patch bias, a class row, a norm before the blocks
        add("v.class_embd", width, dtype=np.float32)
        add("v.pre_ln.weight", width, dtype=np.float32)
        add("v.pre_ln.bias", width, dtype=np.float32)
    else:
        add("v.patch_embd.bias", width, dtype=np.float32)
    add("v.position_embd.weight", patches + llava, width, dtype=np.float32)
    for i in range(layers):
        for proj in ("q", "k", "v", "out"):
            add(f"v.blk.{i}.attn_{proj}.weight", width, width)
            add(f"v.blk.{i}.attn_{proj}.bias", width, dtype=np.float32)
        for norm in ("ln1", "ln2"):
            add(f"v.blk.{i}.{norm}.weight", width, dtype=np.float32)
            add(f"v.blk.{i}.{norm}.bias", width, dtype=np.float32)
        widen, narrow = ("down", "up") if llava else ("up", "down")  # llama.cpp's LLaVA converter swaps the MLP's names
        add(f"v.blk.{i}.ffn_{widen}.weight", g["ffn"], width)
        add(f"v.blk.{i}.ffn_{widen}.bias", g["ffn"], dtype=np.float32)
        add(f"v.blk.{i}.ffn_{narrow}.weight", width, g["ffn"])
        add(f"v.blk.{i}.ffn_{narrow}.bias", width, dtype=np.float32)
    if llava:  # the MLP projector (LLaVA reads the states before CLIP's final norm)
        add("mm.0.weight", g["projection"], width)
        add("mm.0.bias", g["projection"], dtype=np.float32)
        add("mm.2.weight", g["projection"], g["projection"])
        add("mm.2.bias", g["projection"], dtype=np.float32)
    else:
        add("v.post_ln.weight", width, dtype=np.float32)
        add("v.post_ln.bias", width, dtype=np.float32)
        add("mm.soft_emb_norm.weight", width, dtype=np.float32)
        add("mm.input_projection.weight", width, g["projection"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def image_bytes(seed: int) -> bytes:
    """A 1024 x 768 photo-sized PNG of noise, new for each seed (so its digest is new)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (768, 1024, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--projector", type=pathlib.Path)
    parser.add_argument("--synthetic-layers", type=int, default=0)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gemma3")
    parser.add_argument("--tiny", choices=["gemma3-vision", "llava"], default="gemma3-vision")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from corral.images import decode
    from corral.registry import Plugins
    from corral.vision import ImageEncoder

    plugins = Plugins()
    backend = plugins.open_backend(precision=args.precision)
    with tempfile.TemporaryDirectory() as scratch:
        if args.projector is not None:
            path, what = args.projector, str(args.projector)
        elif args.synthetic_layers:
            path = synthetic_projector(pathlib.Path(scratch) / "mmproj.gguf", args.synthetic_layers, args.shape)
            what = f"{args.shape}-shaped, {args.synthetic_layers} of {SHAPES[args.shape]['blocks']} blocks (random f16)"
        else:
            import peers
            from vision_references import cached

            path, what = cached(peers.llama_cpp_sources(), args.tiny).projector, f"the tiny {args.tiny} test model"
        encoder = ImageEncoder.open(path, backend, plugins)
        decode_s, prep_s, encode_s = [], [], []
        for round_ in range(args.rounds + 1):  # the first round warms up
            data = image_bytes(round_)
            start = time.perf_counter()
            image = decode(data)
            decoded = time.perf_counter()
            pixels = encoder.pixels(image)
            prepared = time.perf_counter()
            encoder.encode_pixels(pixels)
            done = time.perf_counter()
            if round_:
                decode_s.append(decoded - start)
                prep_s.append(prepared - decoded)
                encode_s.append(done - prepared)
    print(f"projector: {what}; {encoder.tokens_per_image} tokens per image; precision {args.precision}; threads {torch.get_num_threads()}\n")
    print("| step | best of rounds, ms |\n|---|---|")
    print(f"| decode (1024x768 PNG) | {min(decode_s) * 1e3:.1f} |")
    print(f"| preprocess (resize, normalise) | {min(prep_s) * 1e3:.1f} |")
    print(f"| encode (the graph) | {min(encode_s) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
