"""Chat templates: the model's `tokenizer.chat_template` rendered as Hugging Face does, or a default one;
an Ollama TEMPLATE (Go text/template) rendered as Ollama does.

A file without a template gets its architecture's default (`Model.default_chat_template`, e.g.
Gemma's turns), else ChatML.

Jinja or Go is decided by syntax (`is_go_template`), never by trying one and then the other: a template
is Go when it has no Jinja statement or comment (`{%`, `{#`) and an action that only Go writes: one
starting with a Go keyword (`{{- range .Messages }}`, `{{ if`, `{{ end }}`) or with a Go operand (`.`,
`.Field`, `$x`) standing alone (`{{ .Prompt }}`, `{{ json .Tools }}`, `{{ $.System }}`). Ollama's
TEMPLATEs are Go; GGUF `tokenizer.chat_template`s are Jinja. A Go template that Go would not parse, or
that uses what corral does not implement, is a TemplateError when compiled (so `create` refuses it).

BOS contract (the llama.cpp / Ollama behaviour): `ChatTemplate.render` never starts with the BOS
token's text. Encode its output with `Tokenizer.encode(text, add_special=True, parse_special=True)`,
which adds BOS where the model wants it. A file template that writes ``{{ bos_token }}`` itself has
that leading BOS cut from its output when the tokenizer adds one, exactly as llama.cpp does, so a
prompt never starts with two.
"""

from __future__ import annotations

import datetime
import json
import re
from typing import Any

import attrs
import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

from corral.gotemplate import OllamaTemplate
from corral.gotemplate.errors import TemplateError

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}{{ message['content'] or '' }}{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# An action that only Go writes: a Go keyword first, or a Go operand (`.`, `.Field`, `$x`) after a blank, `(` or `|`.
_GO_ACTION = re.compile(r"\{\{-?\s*(range|if|with|else|end|template|define|block)\b|\{\{-?(?:[^}]*?[\s(|])?[.$]")
_JINJA_TAG = re.compile(r"\{[%#]")

__all__ = ["CHATML", "ChatTemplate", "TemplateError", "compile_template", "is_go_template", "renders_suffix", "renders_tools"]


def is_go_template(text: str) -> bool:
    """Whether a template is Go template syntax (`{{ .Prompt }}`, `{{ range .Messages }}`), not Jinja."""
    return not _JINJA_TAG.search(text) and bool(_GO_ACTION.search(text))


def compile_template(source: str) -> jinja2.Template | OllamaTemplate:
    """A template compiled by its syntax's engine; TemplateError when it does not compile (what create checks)."""
    return OllamaTemplate(source) if is_go_template(source) else _compile(source)


@attrs.frozen
class ChatTemplate:
    """A compiled chat template (Jinja, or an Ollama Go template) with the special-token text it is rendered with."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    strip_bos: bool = False
    _template: jinja2.Template | OllamaTemplate = attrs.field(init=False, repr=False, eq=False)

    @_template.default
    def _compile_source(self) -> jinja2.Template | OllamaTemplate:
        return compile_template(self.source)

    @property
    def is_go(self) -> bool:
        """Whether this is an Ollama (Go) template."""
        return isinstance(self._template, OllamaTemplate)

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], default: str | None = None) -> ChatTemplate:
        """The file's chat template, else `default` (the architecture's), else ChatML."""
        from corral.tokenizer import adds_bos  # tokenizers (a native library): runners load it, the routing server need not

        source = metadata.get("tokenizer.chat_template") or default or CHATML
        tokens = metadata.get("tokenizer.ggml.tokens") or []
        return cls(
            source,
            bos_token=_token_text(tokens, metadata.get("tokenizer.ggml.bos_token_id")),
            eos_token=_token_text(tokens, metadata.get("tokenizer.ggml.eos_token_id")),
            strip_bos=adds_bos(metadata),
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages`, ending with the assistant's turn opener when asked.

        A Go template renders as Ollama renders it (it always ends where the reply starts, so
        `add_generation_prompt` does not apply; `think` in `extra` sets `.Think` and, when a level, `.ThinkLevel`).
        For a Jinja template, `think` sets `enable_thinking` and, when a level, `reasoning_effort`.
        """
        if self.is_go:
            think = extra.get("think")
            level = think if isinstance(think, str) else ""
            text = self._template.render(messages, tools=tools, think=bool(think), think_level=level, is_think_set="think" in extra)
            return self._without_bos(text)
        if "think" in extra:
            # Jinja templates' own switches: Qwen 3's enable_thinking, gpt-oss's reasoning_effort.
            extra = {"enable_thinking": bool(extra["think"]), **extra}
            if isinstance(extra["think"], str):
                extra.setdefault("reasoning_effort", extra["think"])
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            text = self._template.render(context)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template failed: {exc}") from exc
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:
            raise TemplateError(f"the chat template failed on these messages: {exc!r}") from exc
        return self._without_bos(text)

    def _without_bos(self, text: str) -> str:
        if self.strip_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        return text


def renders_tools(source: str) -> bool:
    """Whether a template takes tools: a Go one names `.Tools` (as Ollama checks), a Jinja one `tools`, or writes past
    `tool_calls` (DeepSeek's templates write calls but never list the tools; llama.cpp serves tools to them too)."""
    if is_go_template(source):
        return "tools" in _go_vars(source)
    return "tools" in source or "tool_calls" in source


def renders_suffix(source: str) -> bool:
    """Whether a template fills in the middle (Ollama's "insert" capability): a Go one naming `.Suffix`."""
    return is_go_template(source) and "suffix" in _go_vars(source)


def _go_vars(source: str) -> frozenset[str]:
    try:
        return OllamaTemplate(source).vars
    except TemplateError:
        return frozenset()


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts Hugging Face's ``{% generation %}`` block (a training-mask marker) and renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise TemplateError(f"the chat template rejected the messages: {message}")


def _tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Hugging Face's tojson: plain json.dumps, without Jinja's HTML escaping of <, > and &.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as exc:
        raise TemplateError(f"the chat template does not compile: {exc}") from exc


def _token_text(tokens: list[str], token_id: int | None) -> str:
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else ""
