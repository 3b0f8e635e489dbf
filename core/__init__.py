"""corral: a local LLM runtime for GGUF models on PyTorch."""

__version__ = "0.1.0"

__all__ = ["LoadedModel", "Plugins", "Runtime", "load_model", "load_tokenizer", "__version__"]


def __getattr__(name: str):
    # Lazy, so that `import corral` (and the CLI's --help) does not import torch.
    if name in ("load_model", "LoadedModel"):
        from corral import engine

        return getattr(engine, name)
    if name == "load_tokenizer":
        from corral.tokenizer import load_tokenizer

        return load_tokenizer
    if name == "Runtime":
        from corral.runner.runtime import Runtime

        return Runtime
    if name == "Plugins":
        from corral.registry import Plugins

        return Plugins
    raise AttributeError(f"module 'corral' has no attribute {name!r}")
