"""text/template's built-in functions with Go's semantics (and, or, not, eq... len, index, slice, print...).

Each takes evaluated arguments; `and` and `or` short-circuit in the executor, which calls `truth` itself.
Functions corral does not implement (`call`) are absent, so a template naming one fails to parse.
"""

from __future__ import annotations

import html as _html
import re
import urllib.parse
from collections.abc import Callable
from typing import Any

from corral.gotemplate.errors import TemplateError
from corral.gotemplate.values import NO_VALUE, GoStruct, basic_kind, format_float, sprint, truth, type_name


def _not(value: Any) -> bool:
    return not truth(value)


def _unwrap(value: Any) -> Any:
    return None if value is NO_VALUE else value


def eq(first: Any, *others: Any) -> bool:
    """Whether `first` equals any of `others` (basic kinds only; ints and floats never compare)."""
    if not others:
        raise TemplateError("error calling eq: missing argument for comparison")
    first = _unwrap(first)
    kind = basic_kind(first)
    for other in map(_unwrap, others):
        other_kind = basic_kind(other)
        if kind != other_kind:
            if first is not None and other is not None:
                raise TemplateError("error calling eq: incompatible types for comparison")
            continue
        if kind == "other":
            if isinstance(first, GoStruct) or isinstance(other, GoStruct) or not (first is None or other is None):
                raise TemplateError(f"error calling eq: non-comparable types {type_name(first)}, {type_name(other)}")
        if kind == "invalid" or first == other:
            return True
    return False


def ne(first: Any, second: Any) -> bool:
    return not eq(first, second)


def _ordered(name: str, first: Any, second: Any) -> tuple[Any, Any]:
    first, second = _unwrap(first), _unwrap(second)
    kind, other = basic_kind(first), basic_kind(second)
    if kind not in ("int", "float", "string") or other not in ("int", "float", "string"):
        raise TemplateError(f"error calling {name}: invalid type for comparison")
    if kind != other:
        raise TemplateError(f"error calling {name}: incompatible types for comparison")
    if kind == "string":
        return first.encode(), second.encode()  # Go compares strings byte by byte
    return first, second


def lt(first: Any, second: Any) -> bool:
    a, b = _ordered("lt", first, second)
    return a < b


def le(first: Any, second: Any) -> bool:
    a, b = _ordered("le", first, second)
    return a <= b


def gt(first: Any, second: Any) -> bool:
    a, b = _ordered("gt", first, second)
    return a > b


def ge(first: Any, second: Any) -> bool:
    a, b = _ordered("ge", first, second)
    return a >= b


def length(value: Any) -> int:
    """len: a string's bytes, a slice's or map's items."""
    value = _unwrap(value)
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, (list, tuple, dict, bytes)):
        return len(value)
    if value is None:
        raise TemplateError("error calling len: len of nil pointer")
    raise TemplateError(f"error calling len: len of type {type_name(value)}")


def _int_index(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TemplateError(f"error calling {name}: cannot index slice/array with type {type_name(value)}")
    return value


def index(item: Any, *keys: Any) -> Any:
    """index x 1 2: x[1][2] on slices, strings (a byte) and maps (a missing key gives nil)."""
    item = _unwrap(item)
    for key in keys:
        if isinstance(item, dict):
            item = item.get(key)
        elif isinstance(item, (list, tuple, str)):
            sequence = item.encode() if isinstance(item, str) else item
            i = _int_index(key, "index")
            if not 0 <= i < len(sequence):
                raise TemplateError(f"error calling index: index out of range: {i}")
            item = sequence[i]
        elif item is None:
            raise TemplateError("error calling index: index of untyped nil")
        else:
            raise TemplateError(f"error calling index: can't index item of type {type_name(item)}")
    return item


def slice_(item: Any, *bounds: Any) -> Any:
    """slice x 1 2: x[1:2] on slices and strings (by bytes); a third bound only for slices."""
    item = _unwrap(item)
    if item is None:
        raise TemplateError("error calling slice: slice of untyped nil")
    if not isinstance(item, (list, tuple, str)):
        raise TemplateError(f"error calling slice: can't slice item of type {type_name(item)}")
    if len(bounds) > 3 or (isinstance(item, str) and len(bounds) > 2):
        raise TemplateError(f"error calling slice: too many slice indexes: {len(bounds)}")
    sequence = item.encode() if isinstance(item, str) else item
    indexes = [_int_index(b, "slice") for b in bounds]
    start = indexes[0] if indexes else 0
    end = indexes[1] if len(indexes) > 1 else len(sequence)
    cap = indexes[2] if len(indexes) > 2 else len(sequence)
    if not 0 <= start <= end <= cap <= len(sequence):
        raise TemplateError(f"error calling slice: index out of range: {[start, end, cap][len(indexes) - 1] if indexes else 0}")
    part = sequence[start:end]
    return part.decode("utf-8", errors="replace") if isinstance(item, str) else type(item)(part) if isinstance(item, list) else list(part)


def go_sprint(*args: Any) -> str:
    """fmt.Sprint: a space between operands when neither is a string."""
    out = []
    for i, arg in enumerate(args):
        arg = _unwrap(arg)
        if i and not isinstance(arg, str) and not isinstance(args[i - 1], str):
            out.append(" ")
        out.append(sprint(arg))
    return "".join(out)


def go_sprintln(*args: Any) -> str:
    """fmt.Sprintln: operands always separated by a space, then a newline."""
    return " ".join(sprint(_unwrap(arg)) for arg in args) + "\n"


_VERB = re.compile(r"%([-+# 0]*)(\d+)?(?:\.(\d*))?(.)", re.DOTALL)


def go_sprintf(format: Any, *args: Any) -> str:
    """fmt.Sprintf for the verbs templates use: %v %s %d %q %t %f %e %g %x %X %c %%."""
    if not isinstance(format, str):
        raise TemplateError(f"error calling printf: wrong type for value; expected string; got {type_name(format)}")
    out, used, pos = [], 0, 0
    for match in _VERB.finditer(format):
        out.append(format[pos : match.start()])
        pos = match.end()
        flags, width, precision, verb = match.groups()
        if verb == "%":
            out.append("%")
            continue
        if used >= len(args):
            out.append(f"%!{verb}(MISSING)")
            continue
        arg = _unwrap(args[used])
        used += 1
        out.append(_pad(_format_one(verb, arg, flags, precision), flags, width))
    out.append(format[pos:])
    if used < len(args):
        extra = ", ".join(f"{type_name(_unwrap(a))}={sprint(_unwrap(a))}" for a in args[used:])
        out.append(f"%!(EXTRA {extra})")
    return "".join(out)


def _format_one(verb: str, arg: Any, flags: str, precision: str | None) -> str:
    digits = int(precision) if precision else (0 if precision == "" else None)
    if arg is None:
        return "<nil>" if verb == "v" else f"%!{verb}(<nil>)"
    if verb == "v" or (verb == "s" and not isinstance(arg, (bool, int, float))):
        text = sprint(arg)  # Go's %s of a number is a bad verb; of anything else, its %v
        return text[:digits] if verb == "s" and digits is not None else text
    if verb == "q" and isinstance(arg, str):
        return quote_go(arg)
    if verb == "t" and isinstance(arg, bool):
        return "true" if arg else "false"
    if verb == "d" and isinstance(arg, int) and not isinstance(arg, bool):
        return ("+" if "+" in flags and arg >= 0 else "") + str(arg)
    if verb in "xX" and isinstance(arg, (int, str)) and not isinstance(arg, bool):
        text = format(arg, "x") if isinstance(arg, int) else arg.encode().hex()
        return text.upper() if verb == "X" else text
    if verb == "c" and isinstance(arg, int) and not isinstance(arg, bool):
        return chr(arg)
    if verb in "feg" and isinstance(arg, float):
        if verb == "g" and digits is None:
            return format_float(arg, "g")
        return format(arg, f".{6 if digits is None else digits}{verb}")
    return f"%!{verb}({type_name(arg)}={sprint(arg)})"


def _pad(text: str, flags: str, width: str | None) -> str:
    if not width or len(text) >= int(width):
        return text
    fill = int(width) - len(text)
    if "-" in flags:
        return text + " " * fill
    return ("0" if "0" in flags else " ") * fill + text


def quote_go(text: str) -> str:
    """strconv.Quote: a double-quoted Go string literal."""
    out = ['"']
    for char in text:
        code = ord(char)
        if char in '"\\':
            out.append("\\" + char)
        elif char in "\a\b\f\n\r\t\v":
            out.append("\\" + "abfnrtv"["\a\b\f\n\r\t\v".index(char)])
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02x}")
        elif not char.isprintable() and code > 0x7F:
            out.append(f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
        else:
            out.append(char)
    return "".join(out) + '"'


def _text_of(args: tuple) -> str:
    # Go's escapers take one string as it is, anything else through fmt.Sprint.
    return args[0] if len(args) == 1 and isinstance(args[0], str) else go_sprint(*args)


def html(*args: Any) -> str:
    """template.HTMLEscapeString of the arguments."""
    text = _text_of(args).replace("\0", "\ufffd")
    return _html.escape(text, quote=True).replace("&#x27;", "&#39;").replace("&quot;", "&#34;")


def urlquery(*args: Any) -> str:
    """url.QueryEscape of the arguments."""
    return urllib.parse.quote_plus(_text_of(args), safe="-_.~")


def js(*args: Any) -> str:
    """template.JSEscapeString of the arguments."""
    out = []
    for char in _text_of(args):
        if char in "\\'\"":
            out.append("\\" + char)
        elif char in "<>&=":
            out.append(f"\\u{ord(char):04X}")
        elif ord(char) < 0x20 or char in "\u2028\u2029" or not char.isprintable():
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(char, f"\\u{ord(char):04X}"))
        else:
            out.append(char)
    return "".join(out)


BUILTINS: dict[str, Callable[..., Any]] = {
    "and": truth, "or": truth,  # placeholders: the executor evaluates these lazily
    "not": _not, "eq": eq, "ne": ne, "lt": lt, "le": le, "gt": gt, "ge": ge,
    "len": length, "index": index, "slice": slice_,
    "print": go_sprint, "printf": go_sprintf, "println": go_sprintln,
    "html": html, "js": js, "urlquery": urlquery,
}  # fmt: skip

# Go's fixed arities (None: variadic with that many required at least).
ARITY: dict[str, tuple[int, bool]] = {
    "not": (1, False), "ne": (2, False), "lt": (2, False), "le": (2, False), "gt": (2, False), "ge": (2, False),
    "len": (1, False), "eq": (1, True), "index": (1, True), "slice": (1, True), "printf": (1, True),
    "and": (1, True), "or": (1, True),
}  # fmt: skip
