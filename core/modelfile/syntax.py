"""Modelfile syntax: Ollama's recipe for a model as text, parsed into a `Modelfile` and rendered back.

    FROM ./SmolLM2.gguf              # a GGUF file (relative to the Modelfile) or a model in the store
    PARAMETER temperature 0.2
    PARAMETER stop "<|im_end|>"
    SYSTEM \"\"\"You answer in one sentence.\"\"\"
    MESSAGE user Is the sky blue?
    MESSAGE assistant Yes.

Parsing follows Ollama's rules: instruction names are case-insensitive, `#` starts a comment only at the
start of a line, a value runs to the end of its line unless it is quoted, and a quoted value (`"..."` or
`\"\"\"...\"\"\"`) may span lines and ends at the first line end where the closing quotes stand. There are
no escapes, so a value with a line ending in `\"\"\"` cannot be written in a Modelfile (nor in Ollama's).

TEMPLATE text is kept as given: Hugging Face chat templates are Jinja and Ollama's own Modelfiles carry
Go templates; corral renders both, and `is_go_template` (corral.template) tells the two apart.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import attrs

from corral.errors import CorralError
from corral.options import InvalidOptionError, parse_option_text
from corral.template import is_go_template as is_go_template  # where the rule lives; exported here as before

log = logging.getLogger(__name__)

MESSAGE_ROLES = ("system", "user", "assistant")
# Ollama parameters corral has no use for: Ollama's deprecated ones and its GPU placement knobs. A
# Modelfile written for Ollama may carry them, so they are dropped with a warning instead of refused.
# (mirostat, mirostat_tau and mirostat_eta are options: plugins/samplers/mirostat.py.)
IGNORED_PARAMETERS = frozenset(
    {
        "penalize_newline", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mlock",
        "main_gpu", "use_mmap", "numa",
    }
)  # fmt: skip
_INSTRUCTIONS = ("from", "parameter", "template", "system", "message", "license")
_UNSUPPORTED = {
    "adapter": "ADAPTER is not supported: corral cannot apply LoRA adapters; merge the adapter into "
    "the GGUF (llama.cpp's llama-export-lora) and use FROM with the merged file",
    "draft": "DRAFT is not supported: corral has no speculative decoding",
    "renderer": "RENDERER is not supported by corral",
    "parser": "PARSER is not supported by corral",
    "requires": "REQUIRES is not supported by corral",
}


class ModelfileError(CorralError):
    """A Modelfile that cannot be parsed; the message names the line."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(f"Modelfile line {line}: {message}" if line else f"Modelfile: {message}")
        self.line = line


@attrs.frozen
class Message:
    """A message a model starts every chat with (MESSAGE)."""

    role: str
    content: str

    def to_json(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}

    @classmethod
    def from_json(cls, item: Any) -> Message:
        """A stored or sent {role, content} object; ValueError says what is wrong with it."""
        if not isinstance(item, dict) or not isinstance(item.get("content", ""), str):
            raise ValueError("must be an object with a role and a string content")
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise ValueError(f"role {role!r} must be one of {', '.join(MESSAGE_ROLES)}")
        return cls(role, item.get("content") or "")


@attrs.frozen
class Modelfile:
    """A parsed Modelfile; `parameters` holds typed option values (`stop` a list), ready for JSON."""

    from_: str
    parameters: dict[str, Any] = attrs.field(factory=dict)
    template: str | None = None
    system: str | None = None
    messages: tuple[Message, ...] = ()
    license: tuple[str, ...] = ()
    projector: str | None = None  # a second FROM: the vision projector (mmproj) GGUF, as Ollama takes it

    @classmethod
    def parse(cls, text: str) -> Modelfile:
        """Parse Modelfile text; ModelfileError says what is wrong and on which line."""
        return _Parser(text).modelfile()

    @classmethod
    def read(cls, path: str | os.PathLike) -> Modelfile:
        """Parse a Modelfile on disk."""
        return cls.parse(Path(path).read_text(encoding="utf-8"))

    def render(self) -> str:
        """The Modelfile as text that parses back to an equal Modelfile."""
        lines = [f"FROM {self.from_}"] + ([f"FROM {self.projector}"] if self.projector is not None else [])
        if self.template is not None:
            lines.append(f"TEMPLATE {_quote(self.template)}")
        if self.system is not None:
            lines.append(f"SYSTEM {_quote(self.system)}")
        for name, value in self.parameters.items():
            for item in value if isinstance(value, (list, tuple)) else (value,):
                lines.append(f"PARAMETER {name} {_quote(render_value(item))}")
        lines += [f"LICENSE {_quote(text)}" for text in self.license]
        lines += [f"MESSAGE {m.role} {_quote(m.content)}" for m in self.messages]
        return "\n".join(lines) + "\n"

class _Parser:
    """Ollama's Modelfile grammar over the whole text, tracking the line number."""

    def __init__(self, text: str):
        self.text = text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
        self.pos = 0
        self.line = 1

    def modelfile(self) -> Modelfile:
        found: dict[str, Any] = {"parameters": {}, "messages": [], "license": []}
        while (word := self._next_word()) is not None:
            line, instruction = self.line, word.lower()
            if instruction in _UNSUPPORTED:
                raise ModelfileError(_UNSUPPORTED[instruction], line)
            if instruction not in _INSTRUCTIONS:
                known = ", ".join(name.upper() for name in _INSTRUCTIONS)
                raise ModelfileError(f"unknown instruction {word!r}: use one of {known}", line)
            if instruction == "parameter":
                name = self._word(f"{word} needs a name and a value, as in PARAMETER temperature 0.7").lower()
                _add_parameter(found["parameters"], name, self._value(f"{word} {name}"), line)
            elif instruction == "message":
                role = self._word(f"{word} needs a role and a content, as in MESSAGE user Hello").lower()
                if role not in MESSAGE_ROLES:
                    raise ModelfileError(f"message role {role!r} must be one of {', '.join(MESSAGE_ROLES)}", line)
                found["messages"].append(Message(role, self._value(f"{word} {role}")))
            elif instruction == "from":
                if "projector" in found:
                    raise ModelfileError("a Modelfile has at most two FROM lines (the model, then its vision projector)", line)
                found["projector" if "from_" in found else "from_"] = self._value(word)
            elif instruction == "license":
                found["license"].append(self._value(word))
            else:
                found[instruction] = self._value(word)  # the last TEMPLATE or SYSTEM wins, as in Ollama
        if "from_" not in found:
            raise ModelfileError("no FROM line: start with FROM <model name or GGUF path>")
        found["messages"], found["license"] = tuple(found["messages"]), tuple(found["license"])
        return Modelfile(**found)

    def _next_word(self) -> str | None:
        """The next instruction name, skipping blank lines and comments; None at the end."""
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == "\n":
                self.line += 1
                self.pos += 1
            elif char in " \t":
                self.pos += 1
            elif char == "#":
                end = self.text.find("\n", self.pos)
                self.pos = len(self.text) if end < 0 else end
            else:
                return self._word("")
        return None

    def _word(self, missing: str) -> str:
        """A run of non-blank characters on the current line."""
        self._skip_blanks()
        start = self.pos
        while self.pos < len(self.text) and not self.text[self.pos].isspace():
            self.pos += 1
        if self.pos == start:
            raise ModelfileError(missing, self.line)
        return self.text[start : self.pos]

    def _value(self, what: str) -> str:
        """The argument: the rest of the line, or a quoted value ending at a line end after its closing quotes."""
        self._skip_blanks()
        if self.pos >= len(self.text) or self.text[self.pos] == "\n":
            raise ModelfileError(f"{what} needs a value", self.line)
        start, first_line = self.pos, self.line
        while True:
            end = self.text.find("\n", self.pos)
            end = len(self.text) if end < 0 else end
            value = _unquote(self.text[start:end].strip())
            if value is not None:
                self.pos = end
                return value
            if end == len(self.text):
                quotes = '"""' if self.text.startswith('"""', start) else '"'
                raise ModelfileError(f"{what}: the value opened with {quotes} is never closed", first_line)
            self.pos = end + 1
            self.line += 1

    def _skip_blanks(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1


def _unquote(text: str) -> str | None:
    """The value inside its quotes; None while the closing quotes have not been reached."""
    if text.startswith('"""'):
        return text[3:-3] if len(text) >= 6 and text.endswith('"""') else None
    if text.startswith('"'):
        return text[1:-1] if len(text) >= 2 and text.endswith('"') else None
    return text


def _quote(text: str) -> str:
    # Bare when it parses back unchanged; quoted when blanks at the ends, line breaks or a leading quote
    # would change it. `\"\"\"` when the text holds a quote itself, as Ollama writes it.
    if text and text.strip() == text and "\n" not in text and not text.startswith('"'):
        return text
    return f'"""{text}"""' if '"' in text else f'"{text}"'


def render_value(value: Any) -> str:
    """An option value as a Modelfile writes it (booleans as true and false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _add_parameter(parameters: dict[str, Any], name: str, text: str, line: int) -> None:
    if name in IGNORED_PARAMETERS:
        log.warning("Modelfile line %d: ignoring parameter %r, which corral does not use", line, name)
        return
    try:
        value = parse_option_text(name, text)
    except InvalidOptionError as error:
        raise ModelfileError(str(error), line) from None
    if isinstance(value, list):
        parameters.setdefault(name, []).extend(value)
    else:
        parameters[name] = value  # the last one wins, as in Ollama

