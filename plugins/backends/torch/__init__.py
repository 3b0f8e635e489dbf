"""The PyTorch backend plugin (CPU and CUDA); backend.py says how it holds weights and runs graphs."""

from corral.hookspecs import hookimpl
from corral.plugins.backends.torch.backend import TorchBackend, TorchContext

__all__ = ["TorchBackend", "TorchContext", "register_backends"]


@hookimpl
def register_backends(register):
    register("torch", TorchBackend)
