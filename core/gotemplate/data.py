"""The values Ollama renders its templates with, built from API messages and tools as Ollama builds them.

Ollama decodes a request into its Go types, dropping keys they lack (a tool parameter's `default`, a
tool's `strict`), lower-casing roles and reading every JSON number it keeps as `any` as a float64; the
template then sees converted copies (template/template.go's template* types): tool-call arguments and
tool parameters' properties as Go maps, which print and range in key order and print as JSON.
"""

from __future__ import annotations

from typing import Any

import attrs

from corral.gotemplate.errors import TemplateError
from corral.gotemplate.values import GoMap, GoSlice, GoStruct, marshal


def _json(name: str, omitempty: bool = False, nilable: bool = False) -> dict:
    return {"json": (name, omitempty), "nilable": nilable}


class JSONStringMap(GoMap):
    """templateArgs / templateProperties: a Go map whose String() is its JSON ("{}" when nil)."""

    go_type = "template.templateArgs"

    def go_string(self) -> str:
        return "{}" if self.nil else marshal(self)


class PropertyType(GoSlice):
    """api.PropertyType: one JSON type or several; prints as the one or as [a b], encodes as a string or array."""

    go_type = "api.PropertyType"

    def go_string(self) -> str:
        return "" if not self else self[0] if len(self) == 1 else "[" + " ".join(self) + "]"

    def go_json(self) -> Any:
        return self[0] if len(self) == 1 else (None if self.nil else list(self))


class ToolPropertiesMap(GoMap):
    """*api.ToolPropertiesMap: properties nested in a property, kept in their order."""

    go_type = "*api.ToolPropertiesMap"
    ordered = True


@attrs.define
class ToolProperty(GoStruct):
    go_type = "api.ToolProperty"

    AnyOf: list = attrs.field(factory=list, metadata=_json("anyOf", True))
    Type: PropertyType = attrs.field(factory=PropertyType, metadata=_json("type", True))
    Items: Any = attrs.field(default=None, metadata=_json("items", True, nilable=True))
    Description: str = attrs.field(default="", metadata=_json("description", True))
    Enum: list = attrs.field(factory=list, metadata=_json("enum", True))
    Properties: ToolPropertiesMap | None = attrs.field(default=None, metadata=_json("properties", True, nilable=True))
    Required: list = attrs.field(factory=list, metadata=_json("required", True))

    def to_typescript(self) -> str:
        """api.ToolProperty.ToTypeScriptType."""
        if self.AnyOf:
            return " | ".join(item.to_typescript() for item in self.AnyOf)
        if not self.Type:
            return "any"
        return " | ".join(_TYPESCRIPT.get(name, "any") for name in self.Type)


_TYPESCRIPT = {
    "string": "string", "number": "number", "integer": "number", "boolean": "boolean",
    "array": "any[]", "object": "Record<string, any>", "null": "null",
}  # fmt: skip


@attrs.define
class ToolFunctionParameters(GoStruct):
    go_type = "template.templateToolFunctionParameters"

    Type: str = attrs.field(default="", metadata=_json("type"))
    Defs: Any = attrs.field(default=None, metadata=_json("$defs", True, nilable=True))
    Items: Any = attrs.field(default=None, metadata=_json("items", True, nilable=True))
    Required: list = attrs.field(factory=list, metadata=_json("required", True))
    Properties: JSONStringMap = attrs.field(factory=JSONStringMap, metadata=_json("properties"))


@attrs.define
class ToolFunction(GoStruct):
    go_type = "template.templateToolFunction"

    Name: str = attrs.field(default="", metadata=_json("name"))
    Description: str = attrs.field(default="", metadata=_json("description"))
    Parameters: ToolFunctionParameters = attrs.field(factory=ToolFunctionParameters, metadata=_json("parameters"))


@attrs.define
class Tool(GoStruct):
    go_type = "template.templateTool"

    Type: str = attrs.field(default="", metadata=_json("type"))
    Items: Any = attrs.field(default=None, metadata=_json("items", True, nilable=True))
    Function: ToolFunction = attrs.field(factory=ToolFunction, metadata=_json("function"))

    def go_string(self) -> str:
        return marshal(self)


class Tools(GoSlice):
    """templateTools: prints as its JSON (null when there are none)."""

    go_type = "template.templateTools"

    def go_string(self) -> str:
        return marshal(self)


@attrs.define
class ToolCallFunction(GoStruct):
    go_type = "template.templateToolCallFunction"

    Index: int = 0
    Name: str = ""
    Arguments: JSONStringMap = attrs.field(factory=lambda: _nil(JSONStringMap()))


@attrs.define
class ToolCall(GoStruct):
    go_type = "template.templateToolCall"

    ID: str = ""
    Function: ToolCallFunction = attrs.field(factory=ToolCallFunction)


@attrs.define
class Message(GoStruct):
    """*templateMessage: what `range .Messages` gives."""

    go_type = "template.templateMessage"
    pointer = True

    Role: str = ""
    Content: str = ""
    Thinking: str = ""
    Images: GoSlice = attrs.field(factory=lambda: _nil(GoSlice()))
    ToolCalls: GoSlice = attrs.field(factory=lambda: _nil(GoSlice()))
    ToolName: str = ""
    ToolCallID: str = ""


def _nil(value):
    value.nil = True
    return value


# --- from API JSON --------------------------------------------------------------------------------
def _field(data: dict, key: str, kind: type, default: Any, where: str) -> Any:
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TemplateError(f"{where}.{key} must be {_KIND_NAMES.get(kind, kind.__name__)}")
    return value


_KIND_NAMES = {str: "a string", dict: "an object", list: "a list", int: "an integer"}


def go_any(value: Any) -> Any:
    """A JSON value as Go's `any` holds it: numbers as float64, objects as maps."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict):
        return GoMap({str(k): go_any(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return [go_any(v) for v in value]
    raise TemplateError(f"cannot render a value of type {type(value).__name__}")


def message(data: dict, where: str = "message") -> Message:
    """An API message ({role, content, thinking, images, tool_calls, tool_name, tool_call_id}) for a template."""
    if not isinstance(data, dict):
        raise TemplateError(f"{where} must be an object")
    calls = GoSlice(tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(_field(data, "tool_calls", list, [], where)))
    calls.nil = not calls
    images = GoSlice(_field(data, "images", list, [], where))
    images.nil = not images
    return Message(
        Role=_field(data, "role", str, "", where).lower(),
        Content=_field(data, "content", str, "", where),
        Thinking=_field(data, "thinking", str, "", where),
        Images=images,
        ToolCalls=calls,
        ToolName=_field(data, "tool_name", str, "", where),
        ToolCallID=_field(data, "tool_call_id", str, "", where),
    )


def tool_call(data: dict, where: str) -> ToolCall:
    if not isinstance(data, dict):
        raise TemplateError(f"{where} must be an object")
    function = _field(data, "function", dict, {}, where)
    arguments = function.get("arguments")
    if arguments is not None and not isinstance(arguments, dict):
        raise TemplateError(f"{where}.function.arguments must be an object")
    args = JSONStringMap({str(k): go_any(v) for k, v in (arguments or {}).items()})
    args.nil = arguments is None
    return ToolCall(
        ID=_field(data, "id", str, "", where),
        Function=ToolCallFunction(
            Index=_field(function, "index", int, 0, f"{where}.function"),
            Name=_field(function, "name", str, "", f"{where}.function"),
            Arguments=args,
        ),
    )


def tools(items: list | None) -> Tools:
    """API tools ([{type, function: {name, description, parameters}}]) for a template; nil when none given."""
    if items is None:
        return _nil(Tools())
    return Tools(tool(item, f"tools[{i}]") for i, item in enumerate(items))


def tool(data: dict, where: str) -> Tool:
    if not isinstance(data, dict):
        raise TemplateError(f"{where} must be an object")
    function = _field(data, "function", dict, {}, where)
    parameters = _field(function, "parameters", dict, {}, f"{where}.function")
    properties = _field(parameters, "properties", dict, None, f"{where}.function.parameters")
    props = JSONStringMap({str(k): tool_property(v, f"{where}.function.parameters.properties.{k}") for k, v in (properties or {}).items()})
    props.nil = properties is None
    return Tool(
        Type=_field(data, "type", str, "", where),
        Items=go_any(data.get("items")),
        Function=ToolFunction(
            Name=_field(function, "name", str, "", f"{where}.function"),
            Description=_field(function, "description", str, "", f"{where}.function"),
            Parameters=ToolFunctionParameters(
                Type=_field(parameters, "type", str, "", f"{where}.function.parameters"),
                Defs=go_any(parameters.get("$defs")),
                Items=go_any(parameters.get("items")),
                Required=list(_strings(parameters.get("required"), f"{where}.function.parameters.required")),
                Properties=props,
            ),
        ),
    )


def tool_property(data: Any, where: str) -> ToolProperty:
    if not isinstance(data, dict):
        raise TemplateError(f"{where} must be an object")
    kind = data.get("type")
    types = PropertyType([kind] if isinstance(kind, str) else _strings(kind, f"{where}.type"))
    types.nil = kind is None
    nested = _field(data, "properties", dict, None, where)
    properties = None
    if nested is not None:
        properties = ToolPropertiesMap({str(k): tool_property(v, f"{where}.properties.{k}") for k, v in nested.items()})
    return ToolProperty(
        AnyOf=[tool_property(item, f"{where}.anyOf[{i}]") for i, item in enumerate(_field(data, "anyOf", list, [], where))],
        Type=types,
        Items=go_any(data.get("items")),
        Description=_field(data, "description", str, "", where),
        Enum=[go_any(v) for v in _field(data, "enum", list, [], where)],
        Properties=properties,
        Required=list(_strings(data.get("required"), f"{where}.required")),
    )


def _strings(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TemplateError(f"{where} must be a list of strings")
    return value


def typescript_type(value: Any) -> str:
    """Ollama's toTypeScriptType: a tool property's TypeScript type, "any" for anything else."""
    return value.to_typescript() if isinstance(value, ToolProperty) else "any"
