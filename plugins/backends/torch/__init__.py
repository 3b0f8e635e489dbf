"""The PyTorch backend plugin: CPU and CUDA.

Weights (precision "auto", CPU; layouts in layouts.py): Q4_0/Q4_1/Q4_K linears stay 4-bit
(the native kernel's blocks, else torch's packed int4 layout); other quantized linears become int8
per row; float files stay float32; the logits come from a 4-bit copy with each row's best
candidates recomputed exactly from the file; embeddings are read from the file's memory map. On
CUDA, non-int4 linears are bf16. Precision "fp32" loads everything as float32: the reference mode.
The residual stream, norms and rope run in float32. Measurements: BENCHMARKS.md.

Kernels: torch's, plus native C kernels built for this CPU on first use (native.py) where
torch has none that fits: the 4-bit and int8 matmuls with exact integer products, rms_norm, gated
activations, and attention of every row (prompt or decode) over its own cells; AVX-512 versions,
and AVX2 ones of the int4 matmul, rms_norm and gated activations for CPUs without AVX-512. Without
a C compiler, or a kernel's version for this CPU, the backend runs on torch's.

Batch invariance: a sequence's output must not depend on what it is batched with. The int and
native kernels compute every row alone, and attention reads each sequence's own cache region
(attention.py); BLAS does not (it picks its algorithm by the row count), so a float linear
runs each sequence's prompt chunk as its own call and single rows in chunks of 2..8, and long
prompt runs of the int layouts take their prompt paths (layouts.py) chosen by the run's own
length. An encoder pass (one sequence, no cache view: an image's patches, texts to embed) has
nothing to be batched with: its linears multiply all their rows in one product, even rows its
graph cut or pooled (graph.WHOLE_SEQUENCE).

Graphs are recorded as (function, arguments) nodes (graph.py), rewritten once by the fusion
passes (fusion.py), reused for later batches of the same shape and run eagerly by `compute()`
(as generated straight-line Python from a graph's second run).

Modules: backend.py (tensors loaded, contexts made), context.py (the ops), graph.py, fusion.py,
attention.py, layouts.py (how a weight is held), dequantize.py (GGUF bytes decoded; the IQ, TQ and
FP4 formats in dequantize_iq.py, their tables in codebooks.py, block fields in block_fields.py),
int4_packing.py (torch's int4 kernel layouts), native.py (the C kernels in native/, built and bound).
"""

from corral.hookspecs import hookimpl
from corral.plugins.backends.torch.backend import TorchBackend
from corral.plugins.backends.torch.context import TorchContext

__all__ = ["TorchBackend", "TorchContext", "register_backends"]


@hookimpl
def register_backends(register):
    register("torch", TorchBackend)
