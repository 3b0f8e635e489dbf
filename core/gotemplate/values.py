"""Go values as templates see them: truth, fmt's printing (`%v`), comparison kinds and encoding/json's output.

Python stands in for Go's types: str, bool, int, float (float64) and None (a nil interface) are Go's
basic values; `GoStruct` subclasses are structs, `GoMap` maps (Go ranges and prints them in key order,
`ordered` ones keep their insertion order in JSON like Ollama's ordered maps), lists are slices.
A type with a Go `String()` method overrides `go_string`, one with `MarshalJSON` overrides `go_json`.
"""

from __future__ import annotations

import decimal
import json
from typing import Any, ClassVar

import attrs

from corral.gotemplate.errors import TemplateError


class NoValue:
    """What a missing map key gives in Go's default missingkey mode (an invalid reflect.Value)."""

    def __repr__(self) -> str:
        return "<no value>"


NO_VALUE = NoValue()


class GoStruct:
    """Base of the attrs classes that stand for Go structs; attrs fields are the Go fields, in order.

    A field's metadata `json` is its JSON name and whether it is omitted when empty: ("name", True);
    `nilable` marks an interface or pointer field, which omitempty drops only when nil.
    """

    go_type: ClassVar[str] = "struct"
    pointer: ClassVar[bool] = False  # handled through a pointer (*T), which fmt prints as &{...}

    def go_string(self) -> str | None:
        """The Go `String()` method's result, or None when the type has none."""
        return None

    def go_json(self) -> Any:
        """The JSON-ready value encoding/json writes for the struct (its MarshalJSON, when it has one)."""
        out = {}
        for field in attrs.fields(type(self)):
            name, omitempty = field.metadata.get("json", (field.name, False))
            value = getattr(self, field.name)
            if omitempty and (value is None if field.metadata.get("nilable") else _empty(value)):
                continue
            out[name] = value
        return out


class GoMap(dict):
    """A Go map; `nil` tells a nil map from an empty one, `ordered` keeps insertion order in JSON."""

    go_type: ClassVar[str] = "map[string]interface {}"
    ordered: ClassVar[bool] = False
    nil: bool = False

    def go_string(self) -> str | None:
        return None

    def go_json(self) -> Any:
        return None if self.nil else self


class GoSlice(list):
    """A Go slice whose type has methods (a plain list is a slice without any)."""

    go_type: ClassVar[str] = "[]interface {}"
    nil: bool = False

    def go_string(self) -> str | None:
        return None

    def go_json(self) -> Any:
        return None if self.nil and not self else list(self)


def _empty(value: Any) -> bool:
    """encoding/json's omitempty: false, 0, "", nil and empty slices and maps."""
    if value is None or value is False:
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    if isinstance(value, (str, list, dict, tuple)):
        return len(value) == 0
    return False


def type_name(value: Any) -> str:
    """The Go type of a value, as Go's error messages name it."""
    if value is None or value is NO_VALUE:
        return "interface {}"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float64"
    if isinstance(value, str):
        return "string"
    if isinstance(value, GoStruct):
        return ("*" if value.pointer else "") + value.go_type
    if isinstance(value, (GoMap, GoSlice)):
        return value.go_type
    if isinstance(value, dict):
        return "map[string]interface {}"
    if isinstance(value, list):
        return "[]interface {}"
    return type(value).__name__


def truth(value: Any) -> bool:
    """Go's truth: false, 0, nil, and empty strings, slices and maps are false; structs are true."""
    if value is None or value is NO_VALUE:
        return False
    if isinstance(value, (bool, int, float)):
        return value != 0
    if isinstance(value, (str, list, dict, tuple, bytes)):
        return len(value) > 0
    if isinstance(value, GoStruct):
        return True
    raise TemplateError(f"can't use {value!r} as a condition")


def basic_kind(value: Any) -> str:
    """Go's basicKind for comparisons: bool, int, float, string; "invalid" for nil, else "other"."""
    if value is None or value is NO_VALUE:
        return "invalid"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    return "other"


# --- fmt ---------------------------------------------------------------------------------------
def sprint(value: Any, depth: int = 0) -> str:
    """fmt's `%v` of a value (its String method first, at any depth, as fmt calls it)."""
    if value is None:
        return "<nil>"
    if value is NO_VALUE:
        return "<invalid reflect.Value>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return format_float(value, "g")
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return "[" + " ".join(str(b) for b in value) + "]"
    stringer = getattr(value, "go_string", None)
    text = stringer() if stringer else None
    if text is not None:
        return text
    if isinstance(value, GoStruct):
        if value.pointer and depth > 0:
            raise TemplateError(f"corral cannot print a pointer to {value.go_type} nested in another value")
        inner = " ".join(sprint(getattr(value, f.name), depth + 1) for f in attrs.fields(type(value)))
        return ("&" if value.pointer else "") + "{" + inner + "}"
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda item: _sort_key(item[0]))
        return "map[" + " ".join(f"{sprint(k, depth + 1)}:{sprint(v, depth + 1)}" for k, v in items) + "]"
    if isinstance(value, (list, tuple)):
        return "[" + " ".join(sprint(item, depth + 1) for item in value) + "]"
    raise TemplateError(f"corral cannot print a value of type {type(value).__name__}")


def _sort_key(key: Any) -> Any:
    # Go's fmt and text/template order map keys by value within one key type.
    return (str(type(key)), key)


def format_float(value: float, style: str) -> str:
    """A float64 as Go writes it: fmt's %v ("g": 1e+06) or encoding/json's ("json": 1000000, 1e-7, 1e+21)."""
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    digits_text = repr(value)  # the shortest digits that read back to the same float, like strconv's -1 precision
    sign, digits, exponent = decimal.Decimal(digits_text).as_tuple()
    digits = list(digits)
    while len(digits) > 1 and digits[-1] == 0:
        digits.pop()
        exponent += 1
    if digits == [0]:
        return "-0" if sign else "0"
    decimal_exp = len(digits) + exponent - 1  # the exponent of d.ddd
    if style == "json":
        use_exponent = abs(value) < 1e-6 or abs(value) >= 1e21
    else:  # strconv's 'g' at the shortest precision switches to an exponent at 1e-4 and 1e6... 1e+06
        use_exponent = decimal_exp < -4 or decimal_exp >= 6
    text = "".join(map(str, digits))
    if use_exponent:
        mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
        exp_digits = f"{abs(decimal_exp):02d}" if style == "g" else str(abs(decimal_exp))
        out = f"{mantissa}e{'-' if decimal_exp < 0 else '+'}{exp_digits}"
    elif decimal_exp < 0:
        out = "0." + "0" * (-decimal_exp - 1) + text
    elif len(text) <= decimal_exp + 1:
        out = text + "0" * (decimal_exp + 1 - len(text))
    else:
        out = text[: decimal_exp + 1] + "." + text[decimal_exp + 1 :]
    return ("-" if sign else "") + out


# --- encoding/json -------------------------------------------------------------------------------
def marshal(value: Any) -> str:
    """encoding/json's Marshal: HTML-safe escaping, map keys sorted, struct fields by their json tags."""
    return "".join(_marshal(value))


def _marshal(value: Any):
    if value is None or value is NO_VALUE:
        yield "null"
    elif isinstance(value, bool):
        yield "true" if value else "false"
    elif isinstance(value, int):
        yield str(value)
    elif isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise TemplateError(f"json: unsupported value: {format_float(value, 'g')}")
        yield format_float(value, "json")
    elif isinstance(value, str):
        yield quote_json(value)
    elif isinstance(value, (GoStruct, GoMap, GoSlice)):
        encoded = value.go_json()
        if isinstance(value, GoMap) and encoded is value:
            yield from _marshal_object(value.items() if value.ordered else sorted(value.items()))
        elif isinstance(value, GoStruct) and type(value).go_json is GoStruct.go_json:
            yield from _marshal_object(encoded.items())
        else:
            yield from _marshal(encoded)
    elif isinstance(value, dict):
        yield from _marshal_object(sorted(value.items()))
    elif isinstance(value, (list, tuple)):
        yield "["
        for i, item in enumerate(value):
            if i:
                yield ","
            yield from _marshal(item)
        yield "]"
    else:
        raise TemplateError(f"json: unsupported type: {type(value).__name__}")


def _marshal_object(items):
    yield "{"
    for i, (key, item) in enumerate(items):
        if i:
            yield ","
        yield quote_json(str(key))
        yield ":"
        yield from _marshal(item)
    yield "}"


_HTML_SAFE = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def quote_json(text: str) -> str:
    """A JSON string as Go writes it: <, > and & escaped for HTML, U+2028/9 escaped, the rest as UTF-8."""
    quoted = json.dumps(text, ensure_ascii=False)
    return "".join(_HTML_SAFE.get(char, char) for char in quoted)
