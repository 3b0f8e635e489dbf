"""Errors a user can cause; each message says what went wrong and what to do."""


class CorralError(Exception):
    """Base class of every error corral raises on purpose."""


class GGUFError(CorralError):
    """The file is not a readable GGUF model."""


class NotGGUFError(GGUFError):
    """The file does not start with the GGUF magic."""


class TruncatedGGUFError(GGUFError):
    """The file ends before its header or tensor data says it should."""


class UnknownArchitectureError(CorralError):
    """No installed plugin provides the file's architecture."""


class MissingTensorError(CorralError):
    """A tensor the architecture needs is not in the file."""


class UnsupportedTensorTypeError(CorralError):
    """The backend has no way to load a tensor of this GGML type."""


class ModelNotFoundError(CorralError):
    """No model of that name is in the store and none can be pulled."""


# Errors raised in a runner, defined here rather than in the modules that raise them (corral.memory,
# corral.kvcache, corral.vision, corral.runner.runtime, corral.tokenizer): a runner process's error reaches
# the server by name and becomes the same type (and HTTP status) only if the server has imported the class
# (runner/wire.py), and the routing server does not import those modules (they import numpy, torch or
# tokenizers; BENCHMARKS.md "Server RSS holding 500 open streams").


class InsufficientMemoryError(CorralError):
    """The model does not fit in the memory available, even with the smallest context."""


class CacheFullError(CorralError):
    """No free cells for the batch; the context is full."""


class ProjectorError(CorralError):
    """The projector file does not fit the text model."""


class InvalidPromptError(CorralError, ValueError):
    """The prompt is empty, or its context holds token ids outside the model's vocabulary."""


class InputTooLongError(CorralError, ValueError):
    """An input to embed is longer than the context and the request said not to truncate it."""


class TokenizerError(CorralError):
    """The file's tokenizer metadata is missing, inconsistent or of an unsupported kind."""


class InvalidModelNameError(CorralError):
    """A model name or blob digest that could reach outside the store."""
