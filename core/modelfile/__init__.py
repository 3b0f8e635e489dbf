"""Modelfiles: their text (`syntax`), the models `create` builds from one, and the `defaults` read back."""

from corral.modelfile.create import CreateModelError, ModelSpec, check_spec, create_model, parse_messages, validate_parameters
from corral.modelfile.defaults import ModelDefaults, format_parameters, model_defaults
from corral.modelfile.syntax import IGNORED_PARAMETERS, MESSAGE_ROLES, Message, Modelfile, ModelfileError, is_go_template

__all__ = [
    "IGNORED_PARAMETERS", "MESSAGE_ROLES", "CreateModelError", "Message", "Modelfile", "ModelfileError",
    "ModelDefaults", "ModelSpec", "check_spec", "create_model", "format_parameters", "is_go_template",
    "model_defaults", "parse_messages", "validate_parameters",
]  # fmt: skip
