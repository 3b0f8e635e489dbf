"""Hugging Face safetensors folders to GGUF, written with gguf-py (`FROM ./dir` in a Modelfile).

`convert_folder(folder, out)` writes what llama.cpp's convert_hf_to_gguf.py writes for the same folder:
the same keys and values (general.* included, through gguf.Metadata and the model card) and the same
tensors, names, shapes, types and bytes; tests/test_convert.py proves it for a tiny model of every
architecture corral runs and for all-MiniLM-L6-v2. `check_folder` finds what would stop a conversion
without reading a weight.

Decisions, and where corral differs from llama.cpp's converter on purpose:

* Output type: the folder's own (BF16 stays BF16, F16 stays F16), and F32 stays F32 where llama.cpp's
  `--outtype auto` would halve it; smaller types are quantization's job.
* config.json is read as it is (llama.cpp passes it through transformers' AutoConfig, which fills in
  class defaults); folders saved by transformers hold every setting, older ones may lack a key a
  family needs, which is then a ConvertError naming it.
* `tokenizer.ggml.pre` is recognised from tokenizer.json's pre-tokenizer structure (GPT-2's, Llama 3's,
  Qwen 2's, SmolLM's digit split, BERT's) rather than by hashing a published tokenizer's output; an
  unknown one is written as "default" with a warning, where llama.cpp stops.
* Vision models: the text model here, the vision tower and projector by `convert_projector` into
  llama.cpp's `clip` projector file (corral.convert.projector; Gemma 3 and LLaVA 1.5).
* Not converted (a ConvertError says so): pytorch_model.bin folders, quantized checkpoints (MXFP4,
  NVFP4, FP8), other multimodal towers, StableLM's per-head q/k norms, and a llama folder whose only
  tokenizer is a sentencepiece-style tokenizer.json (llama.cpp reads those through transformers).
"""

from corral.convert.architectures import FAMILIES
from corral.convert.folder import ConvertError, HFFolder
from corral.convert.projector import VISION_FAMILIES, check_projector, convert_projector
from corral.convert.writer import check_folder, convert_folder

__all__ = ["FAMILIES", "VISION_FAMILIES", "ConvertError", "HFFolder", "check_folder", "check_projector", "convert_folder", "convert_projector"]
