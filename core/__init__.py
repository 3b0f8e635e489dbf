"""corral: a local LLM runtime for GGUF models on PyTorch."""

__version__ = "0.1.0"
