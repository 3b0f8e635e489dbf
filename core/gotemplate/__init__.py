"""Go text/template, as Ollama's TEMPLATEs need it: lexer, parser, executor, Go's values and Ollama's rules.

`OllamaTemplate(source)` parses (raising TemplateError for what Go or corral refuses) and
`.render(messages, tools)` gives the prompt Ollama would.
"""

from corral.gotemplate.errors import TemplateError
from corral.gotemplate.ollama import OllamaTemplate

__all__ = ["OllamaTemplate", "TemplateError"]
