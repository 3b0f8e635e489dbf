"""Request options: Ollama's `options` object, its defaults, and strict parsing of what a client sends.

    opts = parse_options(body.get("options"), chain.extra_options)
    parse_option_text("temperature", "0.2")   # a Modelfile PARAMETER's or `/set parameter`'s text -> 0.2

A wrongly typed or out-of-range value is an `InvalidOptionError`; an unknown key is ignored with a
logged warning, unless a registered sampler declares it, in which case it lands in `Options.extra`.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any, Callable

import attrs

from corral.errors import CorralError

log = logging.getLogger(__name__)

# Changing one of these forces the model to be reloaded.
LOAD_TIME_OPTIONS = ("num_ctx", "num_batch", "num_gpu", "num_thread", "tensor_parallel", "pipeline_parallel", "kv_cache_type")
# How the KV cache holds keys and values (core/kvcache.py), named as Ollama's OLLAMA_KV_CACHE_TYPE names them:
# 16-bit floats (the default), or ggml's q8_0 / q4_0 blocks of 32 values and a scale (about 1/2 and 1/4 of the memory).
KV_CACHE_TYPES = ("f16", "q8_0", "q4_0")
DEFAULT_KV_CACHE_TYPE = "f16"


class InvalidOptionError(CorralError):
    """A request option has the wrong type or is out of range."""


def checked_kv_cache_type(value: object, source: str = "kv_cache_type") -> str:
    """`value`, a KV cache type name (KV_CACHE_TYPES); InvalidOptionError naming `source` otherwise."""
    name = value.strip() if isinstance(value, str) else value
    if name not in KV_CACHE_TYPES:
        raise InvalidOptionError(f"{source} must be one of {', '.join(KV_CACHE_TYPES)}, got {value!r}")
    return name


@attrs.frozen
class Check:
    """A range an option must lie in: `lo <= value <= hi` (None: unbounded)."""

    lo: float | None = None
    hi: float | None = None
    lo_exclusive: bool = False

    def __call__(self, value: float) -> bool:
        above = self.lo is None or (value > self.lo if self.lo_exclusive else value >= self.lo)
        return above and (self.hi is None or value <= self.hi)

    def describe(self) -> str:
        lo = None if self.lo is None else f"{'>' if self.lo_exclusive else '>='} {self.lo}"
        hi = None if self.hi is None else f"<= {self.hi}"
        return " and ".join(part for part in (lo, hi) if part)


def option(default: Any, kind: type | str, check: Check | None = None) -> Any:
    return attrs.field(default=default, metadata={"kind": kind, "check": check})


@attrs.frozen
class Options:
    """Every Ollama option with its default; `extra` holds the options third-party samplers declare."""

    num_ctx: int | None = option(None, int, Check(1))  # None: the runtime decides (memory, Modelfile, env)
    num_batch: int = option(512, int, Check(1))
    num_gpu: int = option(-1, int, Check(-1))  # -1: as many layers as fit
    num_thread: int = option(0, int, Check(0))  # 0: the runtime decides
    tensor_parallel: int = option(0, int, Check(0))  # ranks the model is split over (corral.parallel); 0: the server's default
    pipeline_parallel: int = option(0, int, Check(0))  # stages the model's blocks are split into; 0: the server's default
    kv_cache_type: str | None = option(None, "kv_cache_type")  # KV_CACHE_TYPES; None: the server's (OLLAMA_KV_CACHE_TYPE)
    num_keep: int = option(4, int, Check(-1))  # -1: the whole prompt
    num_predict: int = option(-1, int, Check(-2))  # -1: unlimited, -2: until the context is full
    stop: tuple[str, ...] = option((), "strings")
    temperature: float = option(0.8, float, Check(0.0))  # 0: greedy
    top_k: int = option(40, int, Check(0))  # 0: disabled
    top_p: float = option(0.9, float, Check(0.0, 1.0))  # 1: disabled
    min_p: float = option(0.0, float, Check(0.0, 1.0))  # 0: disabled
    typical_p: float = option(1.0, float, Check(0.0, 1.0))  # 1: disabled
    repeat_last_n: int = option(64, int, Check(-1))  # -1: num_ctx, 0: no penalties
    repeat_penalty: float = option(1.0, float, Check(0.0, lo_exclusive=True))  # 1: disabled
    presence_penalty: float = option(0.0, float)
    frequency_penalty: float = option(0.0, float)
    seed: int = option(-1, int)  # negative: random
    # Mirostat (llama.cpp's algorithms, plugins/samplers/mirostat.py): 0 off, 1 or 2 the version. It replaces the
    # truncating steps (top_k, typical_p, top_p, min_p, xtc) with its own, steered to a target surprise tau.
    mirostat: int = option(0, int, Check(0, 2))
    mirostat_tau: float = option(5.0, float, Check(0.0))
    mirostat_eta: float = option(0.1, float, Check(0.0))
    ignore_eos: bool = option(False, bool)  # generate past end-of-generation tokens (llama.cpp's, vLLM's; for benchmarks)
    extra: dict[str, Any] = attrs.field(factory=dict)

    def get(self, name: str, default: Any = None) -> Any:
        """A standard option by name, else a third-party one from `extra`, else `default`."""
        if name in STANDARD_OPTIONS:
            return getattr(self, name)
        return self.extra.get(name, default)


STANDARD_OPTIONS = {field.name: field for field in attrs.fields(Options) if field.name != "extra"}


def parse_options(raw: dict | None, extra_fields: dict[str, tuple] | None = None) -> Options:
    """Validate a request's `options` object into `Options`; `extra_fields` are the samplers' own options,
    each `(kind, default)` or `(kind, default, Check)`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InvalidOptionError(f"options must be an object mapping option names to values, got {_show(raw)}")
    extra_fields = {name: spec for name, spec in (extra_fields or {}).items() if name not in STANDARD_OPTIONS}
    values: dict[str, Any] = {}
    extra = {name: spec[1] for name, spec in extra_fields.items()}
    for name, value in raw.items():
        if value is None:  # JSON null: the default, as if the key were absent
            continue
        if name in STANDARD_OPTIONS:
            field = STANDARD_OPTIONS[name]
            values[name] = _validate(name, value, field.metadata["kind"], field.metadata["check"])
        elif name in extra_fields:
            spec = extra_fields[name]
            extra[name] = _validate(name, value, spec[0], spec[2] if len(spec) > 2 else None)
        else:
            log.warning("ignoring unknown option %r", name)
    return Options(**values, extra=extra)


def parse_option_text(name: str, text: str) -> Any:
    """A standard option's value written as text (a Modelfile PARAMETER, `/set parameter`), typed and checked.

    The value is JSON-ready, as a request's `options` would carry it: `stop` text is one stop string,
    returned as a list of it. Booleans are spelled as Go's strconv.ParseBool spells them, as Ollama reads them.
    """
    field = STANDARD_OPTIONS.get(name)
    if field is None:
        raise InvalidOptionError(f"unknown parameter {name!r}: use one of {', '.join(STANDARD_OPTIONS)}")
    kind = field.metadata["kind"]
    value = _TEXT_PARSERS.get(kind, str)(text)
    if value is _INVALID:
        raise InvalidOptionError(f"parameter {name!r} must be {_describe(kind)}, got {text!r}")
    checked = parse_options({name: value}).get(name)  # range checks
    return list(checked) if isinstance(checked, tuple) else checked


TRUE_TEXTS = frozenset({"1", "t", "T", "TRUE", "true", "True"})
FALSE_TEXTS = frozenset({"0", "f", "F", "FALSE", "false", "False"})
_INTEGER_TEXT = re.compile(r"[+-]?[0-9]+")


def _int_text(text: str) -> Any:
    return int(text) if _INTEGER_TEXT.fullmatch(text) else _INVALID


def _float_text(text: str) -> Any:
    try:
        return float(text) if "_" not in text else _INVALID  # Python's underscores are not Go's
    except ValueError:
        return _INVALID


def _bool_text(text: str) -> Any:
    return True if text in TRUE_TEXTS else False if text in FALSE_TEXTS else _INVALID


def _validate(name: str, value: Any, kind: type | str, check: Check | None) -> Any:
    converted = CONVERTERS.get(kind, _instance_of(kind))(value)
    if converted is _INVALID:
        raise InvalidOptionError(f"option {name!r} must be {_describe(kind)}, got {_show(value)}")
    if check is not None and isinstance(converted, (int, float)) and not check(converted):
        raise InvalidOptionError(f"option {name!r} must be {check.describe()}, got {value!r}")
    return converted


_INVALID = object()


def _to_int(value: Any) -> Any:
    # bool is an int subclass in Python, but `true` is not a number in JSON. A float is accepted only
    # when it is integral (40.0), since some JSON encoders write every number as a float.
    if isinstance(value, bool):
        return _INVALID
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return _INVALID


def _to_float(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _INVALID
    return float(value) if math.isfinite(value) else _INVALID


def _to_strings(value: Any) -> Any:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return tuple(value)
    return _INVALID


MAX_LOGIT_BIAS = 100.0


def _to_token_biases(value: Any) -> Any:
    """OpenAI's `logit_bias` ({"token id": bias}) or llama.cpp's list of [id, bias] pairs, as sorted (id, bias)
    pairs; each bias in [-100, 100]. Token ids are checked against the model's vocabulary when a sequence starts."""
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in value):
        pairs = [tuple(pair) for pair in value]
    else:
        return _INVALID
    biases = {}
    for key, bias in pairs:
        token = _to_int(int(key)) if isinstance(key, str) and _INTEGER_TEXT.fullmatch(key) else _to_int(key)
        bias = _to_float(bias)
        if token is _INVALID or token < 0 or bias is _INVALID or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            return _INVALID
        biases[token] = bias
    return tuple(sorted(biases.items()))


def _instance_of(kind: type) -> Callable[[Any], Any]:
    return lambda value: value if isinstance(value, kind) else _INVALID


def _to_kv_cache_type(value: Any) -> Any:
    return value if isinstance(value, str) and value in KV_CACHE_TYPES else _INVALID


CONVERTERS: dict[type | str, Callable[[Any], Any]] = {
    int: _to_int,
    float: _to_float,
    "strings": _to_strings,
    bool: _instance_of(bool),
    str: _instance_of(str),
    "token_biases": _to_token_biases,
    "kv_cache_type": _to_kv_cache_type,
}

_TEXT_PARSERS: dict[type | str, Callable[[str], Any]] = {
    int: _int_text,
    float: _float_text,
    bool: _bool_text,
    "strings": lambda text: [text],
}

_DESCRIPTIONS = {
    int: "an integer",
    float: "a number",
    "strings": "a string or a list of strings",
    bool: "true or false",
    str: "a string",
    "token_biases": f"an object mapping token ids to biases from {-MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g}",
    "kv_cache_type": f"one of {', '.join(KV_CACHE_TYPES)}",
}


def _describe(kind: type | str) -> str:
    return _DESCRIPTIONS.get(kind) or f"of type {getattr(kind, '__name__', kind)}"


def _show(value: Any) -> str:
    shown = repr(value)
    return f"{type(value).__name__} {shown[:60] + '...' if len(shown) > 60 else shown}"


# --- the same declarations as JSON schema (/openapi.json): the schema rejects what parsing rejects ----------

_KIND_SCHEMAS: dict[type | str, dict] = {
    "kv_cache_type": {"type": "string", "enum": list(KV_CACHE_TYPES), "description": "How the KV cache holds keys and values (a load-time option)"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    str: {"type": "string"},
    "strings": {"type": ["string", "array"], "items": {"type": "string"}},
    "token_biases": {
        "type": ["object", "array"],
        "propertyNames": {"pattern": "^[+]?[0-9]+$"},
        "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS},
        "items": {
            "type": "array", "minItems": 2, "maxItems": 2,
            "prefixItems": [{"type": "integer", "minimum": 0}, {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS}],
        },
        "description": "Token id -> bias added to its logit (OpenAI's object, or llama.cpp's [[id, bias], ...])",
    },
}  # fmt: skip


def value_schema(kind: type | str, check: Check | None = None) -> dict:
    """The JSON schema of an option's values: its type and, where it has one, its range."""
    schema = dict(_KIND_SCHEMAS.get(kind, {}))
    if check is not None and check.lo is not None:
        schema["exclusiveMinimum" if check.lo_exclusive else "minimum"] = check.lo
    if check is not None and check.hi is not None:
        schema["maximum"] = check.hi
    return schema


def options_schema(extra_fields: dict[str, tuple] | None = None) -> dict:
    """The schema of a request's `options`: every standard option and each `(kind, default[, Check])` a sampler
    declares, typed and ranged as `parse_options` checks them; unknown names are allowed (and ignored)."""
    properties = {name: value_schema(field.metadata["kind"], field.metadata["check"]) for name, field in STANDARD_OPTIONS.items()}
    for name, spec in (extra_fields or {}).items():
        properties.setdefault(name, value_schema(spec[0], spec[2] if len(spec) > 2 else None))
    return {
        "type": "object", "properties": properties, "additionalProperties": True,
        "description": "Model options; installed sampler plugins may declare more. Unknown names are ignored with a logged warning.",
    }  # fmt: skip
