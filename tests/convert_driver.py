"""Build the tiny reference models of reference_models.SPECS and convert each with llama.cpp's converter.

    python tests/convert_driver.py LLAMA_CPP_DIR OUT_DIR [SPEC_NAME ...]

For each spec (all of them when none is named) it writes, under OUT_DIR/<name>/:
`hf/` (the transformers model, saved with `save_pretrained`, and its tokenizer), `reference.npz`
(`ids` and transformers' float32 `logits` on them), and `model.gguf` from `convert_hf_to_gguf.py
--outtype f32`, or `error.txt` with the traceback where building or converting failed.

It runs as its own process because the converter puts llama.cpp's vendored gguf-py ahead of the
installed one on sys.path; one process converts them all, so torch and transformers are imported once.
"""

from __future__ import annotations

import logging
import pathlib
import sys
import traceback

# The pre-tokenizer name written for the tiny BPE tokenizers: they split text with GPT-2's regex, and
# the converter, which recognises a pre-tokenizer only by hashing a published tokenizer's output,
# cannot tell that on its own.
BPE_PRE_TOKENIZER = "gpt-2"
SEED = 0
NOISE = 0.1  # std of what `perturb` adds


def import_converter(llama_cpp: pathlib.Path):
    """llama.cpp's convert_hf_to_gguf module, with its own gguf-py, and tokenizer detection set to the tiny ones."""
    sys.path.insert(0, str(llama_cpp))
    import convert_hf_to_gguf
    import gguf
    from conversion import TextModel

    assert pathlib.Path(gguf.__file__).is_relative_to(llama_cpp), f"the converter must use its own gguf-py, not {gguf.__file__}"
    TextModel.get_vocab_base_pre = lambda self, tokenizer: BPE_PRE_TOKENIZER
    return convert_hf_to_gguf


def perturb(model) -> None:
    """Add noise to every saved tensor that transformers starts at one constant: norms at 1 (or 0 where
    stored as an offset), biases at 0, DeepSeek's routing correction bias at 0; a mistake in how
    corral reads one would not show otherwise."""
    import torch

    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point() and tensor.numel() > 1 and bool((tensor == tensor.flatten()[0]).all()):
                tensor.add_(torch.randn(tensor.shape, generator=generator) * NOISE)


def build(spec, folder: pathlib.Path):
    """The spec's transformers model, seeded, float32, saved to `folder` with its tokenizer."""
    import torch
    import transformers

    from reference_models import TOKENIZER_WRITERS

    folder.mkdir()
    settings = spec.config_settings()
    special_ids = TOKENIZER_WRITERS[spec.tokenizer](folder, settings["vocab_size"])
    config = getattr(transformers, spec.config_class)(**{**special_ids, **settings}, attn_implementation="eager")
    torch.manual_seed(SEED)
    model = getattr(transformers, spec.model_class)(config).to(torch.float32).eval()
    perturb(model)
    model.save_pretrained(folder)
    return model


def reference_logits(model, ids: list[int]):
    """transformers' float32 logits [len(ids), vocab] of one forward over `ids`."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()


def convert(converter, folder: pathlib.Path, out: pathlib.Path) -> None:
    """Run convert_hf_to_gguf.py's main on `folder`, as its command line would."""
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(folder), "--outtype", "f32", "--outfile", str(out)]
    try:
        converter.main()
    finally:
        sys.argv = argv


def main(llama_cpp: str, out_dir: str, *names: str) -> None:
    logging.basicConfig(level=logging.WARNING)  # before the converter's own INFO set-up, which then does nothing
    converter = import_converter(pathlib.Path(llama_cpp).resolve())
    import numpy as np

    from reference_models import SPECS, SPECS_BY_NAME, reference_ids

    for spec in [SPECS_BY_NAME[n] for n in names] or SPECS:
        target = pathlib.Path(out_dir) / spec.name
        target.mkdir(parents=True)
        try:
            model = build(spec, target / "hf")
            ids = reference_ids(spec)
            np.savez(target / "reference.npz", ids=np.array(ids), logits=reference_logits(model, ids))
            convert(converter, target / "hf", target / "model.gguf")
        except (Exception, SystemExit):
            (target / "error.txt").write_text(traceback.format_exc())
            print(f"{spec.name}: failed, see {target / 'error.txt'}", file=sys.stderr)


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    main(*sys.argv[1:])
