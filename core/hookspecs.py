"""The hooks a corral plugin implements; each one only registers things."""

import pluggy

hookspec = pluggy.HookspecMarker("corral")
hookimpl = pluggy.HookimplMarker("corral")


@hookspec
def register_architectures(register):
    """Call `register(name, ModelClass)` for each architecture (the GGUF `general.architecture`)."""


@hookspec
def register_backends(register):
    """Call `register(name, BackendClass)` for each tensor backend."""


@hookspec
def register_samplers(register):
    """Call `register(name, SamplerClass)` for each sampler or logits processor of the chain."""


@hookspec
def register_tool_parsers(register):
    """Call `register(name, ParserClass)` for each tool-call syntax (a `corral.toolcalls.ToolCallParser`)."""


@hookspec
def register_vision_encoders(register):
    """Call `register(projector_type, EncoderClass)` for each vision encoder (a projector file's `clip.projector_type`)."""
