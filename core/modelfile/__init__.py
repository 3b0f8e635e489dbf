"""Modelfiles: Ollama's recipe for a model (see `syntax`), the models `create` builds from one, the defaults read back."""

from corral.modelfile.syntax import (
    IGNORED_PARAMETERS,
    MESSAGE_ROLES,
    CreateModelError,
    Message,
    Modelfile,
    ModelfileError,
    ModelDefaults,
    ModelSpec,
    check_spec,
    create_model,
    format_parameters,
    is_go_template,
    model_defaults,
    parse_messages,
    validate_parameters,
)

__all__ = [
    "IGNORED_PARAMETERS", "MESSAGE_ROLES", "CreateModelError", "Message", "Modelfile", "ModelfileError",
    "ModelDefaults", "ModelSpec", "check_spec", "create_model", "format_parameters", "is_go_template",
    "model_defaults", "parse_messages", "validate_parameters",
]  # fmt: skip
