"""The error a chat template raises, Go or Jinja: it does not parse, or it fails on the data it is given."""

from corral.errors import CorralError


class TemplateError(CorralError):
    """A chat template that does not compile, uses what corral does not implement, or fails on its messages."""
