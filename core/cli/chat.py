"""A conversation with a model: its history and options, and the interactive `>>>` session with its /commands."""

from __future__ import annotations

import pathlib
import re
import sys
from typing import Any

import attrs
import click

from corral.cli.backends import LocalChat, ServerChat, ThinkingText
from corral.cli.display import print_error, print_metrics, print_model_info
from corral.client import ServerUnreachableError
from corral.errors import CorralError
from corral.options import InvalidOptionError, parse_option_text
from corral.thinking import LEVELS


@attrs.define
class ChatSession:
    """One conversation: the backend answering it, the options and system message, and the history."""

    backend: ServerChat | LocalChat
    options: dict = attrs.field(factory=dict)
    system: str | None = None
    history: list[dict] = attrs.field(factory=list)
    verbose: bool = False

    def messages(self) -> list[dict]:
        """What the next request sends: the system message, then the turns so far."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history

    def ask(self, text: str) -> str:
        """Send a user turn, echo the reply as it streams, and keep both in the history.

        Paths of image files in the text (`describe ./cat.png`) are attached to the turn as Ollama's CLI
        attaches them, and taken out of its text.
        """
        text, images = attach_images(text)
        self.history.append({"role": "user", "content": text} | ({"images": images} if images else {}))
        pieces: list[str] = []
        thinking = False
        try:
            for piece in self.backend.stream(self.messages(), self.options):
                if isinstance(piece, ThinkingText):
                    if not thinking:
                        click.secho("Thinking...", dim=True)
                    thinking = True
                    click.secho(piece, nl=False, dim=True)
                    continue
                if thinking and piece:
                    click.secho("\n...done thinking.\n", dim=True)
                    thinking = False
                pieces.append(piece)
                click.echo(piece, nl=False)
        except BaseException:
            self.history.pop()  # an unanswered question would confuse the next turn
            if pieces:
                click.echo()
            raise
        click.echo()
        reply = "".join(pieces)
        self.history.append({"role": "assistant", "content": reply})
        if self.verbose:
            print_metrics(self.backend.metrics)
        return reply


# An image file's path in a message: absolute, ~, ./ or ../, spaces escaped with a backslash, one of these extensions.
IMAGE_PATH = re.compile(r"(?:~|\.{1,2})?/(?:[^\s\\'\"]|\\ )+?\.(?:png|jpe?g|webp|gif|bmp)\b", re.IGNORECASE)


def attach_images(text: str) -> tuple[str, list[bytes]]:
    """The text without the paths of the image files it names, and those files' bytes, in order.

    A path that names no file stays in the text; a file that cannot be read is an error."""
    images: list[bytes] = []
    kept = text
    for match in IMAGE_PATH.finditer(text):
        path = pathlib.Path(match.group(0).replace("\\ ", " ")).expanduser()
        if not path.is_file():
            continue
        try:
            images.append(path.read_bytes())
        except OSError as exc:
            raise CorralError(f"cannot read the image {path}: {exc.strerror}") from None
        click.secho(f"Added image '{path}'", dim=True, err=True)
        kept = kept.replace(match.group(0), "", 1)
    return (" ".join(kept.split()) if images else text), images


INTERACTIVE_HELP = """Available Commands:
  /set            Set session variables
  /show           Show model information
  /clear          Clear session context
  /bye            Exit
  /?, /help       Help for a command

Use \"\"\" to begin a multi-line message."""

SET_HELP = """Available Commands:
  /set parameter NAME VALUE   Set a parameter (temperature, num_predict, seed, top_k, stop, ...)
  /set system TEXT            Set the system message
  /set format json            Answer in JSON
  /set noformat               Answer in any format
  /set think [low|medium|high] Think before answering (a level where the model takes one)
  /set nothink                Answer without thinking
  /set verbose                Show timings after each answer
  /set quiet                  Do not show timings"""

SHOW_HELP = """Available Commands:
  /show info         Show details for this model
  /show license      Show model license
  /show modelfile    Show Modelfile for this model
  /show parameters   Show parameters for this model
  /show system       Show system message
  /show template     Show prompt template"""


def chat_interactively(session: ChatSession) -> None:
    """The `>>>` loop: messages (multi-line between \"\"\" lines) and /commands, until /bye or end of input."""
    _enable_line_editing()
    while True:
        try:
            line = _read(">>>")
            if line.lstrip().startswith('"""'):
                text = _read_multiline(line.lstrip()[3:])
            elif line.strip().startswith("/"):
                if not run_command(session, line.strip()):
                    return
                continue
            else:
                text = line.strip()
        except (EOFError, click.Abort):
            click.echo()
            return
        if not text:
            continue
        try:
            session.ask(text)
        except KeyboardInterrupt:
            continue  # stop this answer, keep chatting
        except ServerUnreachableError:
            raise
        except CorralError as exc:
            print_error(exc)
        click.echo()


def _read(prompt: str) -> str:
    return click.prompt(prompt, prompt_suffix=" ", default="", show_default=False)


def _read_multiline(first: str) -> str:
    lines, line = [], first
    while not line.rstrip().endswith('"""'):
        lines.append(line)
        line = _read("...")
    lines.append(line.rstrip()[:-3])
    return "\n".join(lines).strip()


def _enable_line_editing() -> None:
    # input() gains arrow keys and a history of typed lines once readline is imported.
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401
        except ImportError:
            pass


def run_command(session: ChatSession, line: str) -> bool:
    """Carry out one /command; False when the chat should end."""
    command, *args = line.split()
    if command in ("/bye", "/exit"):
        return False
    if command in ("/?", "/help"):
        click.echo(SET_HELP if args[:1] == ["/set"] else SHOW_HELP if args[:1] == ["/show"] else INTERACTIVE_HELP)
    elif command == "/clear":
        session.history.clear()
        click.echo("Cleared session context")
    elif command == "/set":
        _set(session, line.split(None, 2)[1:])
    elif command == "/show":
        _show(session, args[0] if args else "")
    else:
        click.echo(f"Unknown command '{command}'. Type /? for help")
    if args[:1] != ["info"]:  # the info sections end with their own blank line
        click.echo()
    return True


def _set(session: ChatSession, args: list[str]) -> None:
    what = args[0] if args else ""
    rest = args[1] if len(args) > 1 else ""
    if what == "parameter":
        name, _, value = rest.partition(" ")
        try:
            session.options[name] = _option_value(name, value.strip())
        except InvalidOptionError as exc:
            click.echo(f"Couldn't set parameter: {exc}")
            return
        click.echo(f"Set parameter '{name}' to '{value.strip()}'")
    elif what == "system":
        session.system = rest.strip().strip('"') or None
        click.echo("Set system message.")
    elif what in ("verbose", "quiet"):
        session.verbose = what == "verbose"
        click.echo("Set 'verbose' mode." if session.verbose else "Set 'quiet' mode.")
    elif what in ("think", "nothink"):
        level = rest.strip()
        if what == "think" and level and level not in LEVELS:
            click.echo(f"Couldn't set think: use /set think, or /set think {'|'.join(LEVELS)}")
            return
        session.backend.think = (level or True) if what == "think" else False
        click.echo(f"Set 'think' mode{f' to {level}' if level else ''}." if what == "think" else "Set 'nothink' mode.")
    elif what in ("format", "noformat"):
        session.backend.format = "json" if what == "format" else None
        click.echo("Set format to 'json' mode." if what == "format" else "Disabled format.")
    else:
        click.echo(SET_HELP)


def _option_value(name: str, text: str) -> Any:
    """A `/set parameter` value typed and checked as the option wants it (as a Modelfile PARAMETER is)."""
    if not text:
        raise InvalidOptionError(f"give a value: /set parameter {name} VALUE")
    value = parse_option_text(name, text)
    if isinstance(value, list):  # `/set parameter stop <a> <b>` sets two stop strings, as Ollama's does
        value = [item for word in text.split() for item in parse_option_text(name, word)]
    return value


def _show(session: ChatSession, what: str) -> None:
    if what not in ("info", "license", "modelfile", "parameters", "system", "template"):
        click.echo(SHOW_HELP)
        return
    info = session.backend.describe()
    if what == "info":
        print_model_info(info)
    elif what == "parameters":
        model_parameters = (info.get("parameters") or "").strip()
        if model_parameters:
            click.echo("Model defined parameters:\n" + model_parameters)
        if session.options:
            click.echo("User defined parameters:")
            for name, value in session.options.items():
                click.echo(f"{name:<20}{value}")
        if not model_parameters and not session.options:
            click.echo("No parameters were specified for this model.")
    elif what == "system":
        click.echo(session.system or info.get("system") or "No system message was specified for this model.")
    else:
        click.echo(info.get(what) or f"No {what} was specified for this model.")
