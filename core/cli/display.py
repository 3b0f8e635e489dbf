"""What the CLI prints: errors, pull progress, model details, timings, and sizes and times as Ollama writes them."""

from __future__ import annotations

import datetime
from typing import Any

import click
import rich.markup
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

console = Console()
err_console = Console(stderr=True)


def print_error(exc: BaseException) -> None:
    """One `Error: ...` line on stderr, unwrapped, with the message printed literally."""
    err_console.print("[red]Error:[/red]", rich.markup.escape(str(exc)), highlight=False, soft_wrap=True)



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
            if self._bar is not None:
                # The layers are done: leave their bars as they stand, so later lines follow them (as Ollama's do).
                self._bar.__exit__(None, None, None)
                self._bar, self._tasks = None, {}
            err_console.print(status, highlight=False, soft_wrap=True)
            self._last_line = status


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


def short_id(digest: str) -> str:
    """The 12 hex digits `list` and `ps` show of a digest."""
    return digest.removeprefix("sha256:")[:12]


def parse_time(text: str | None) -> datetime.datetime | None:
    """An RFC 3339 time from the server, or None when absent or unreadable."""
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def processor_text(size: int, size_vram: int) -> str:
    """`ps`'s PROCESSOR column: how much of the model is on the GPU ("100% CPU", "48%/52% CPU/GPU")."""
    if not size or size_vram <= 0:
        return "100% CPU"
    if size_vram >= size:
        return "100% GPU"
    gpu = round(size_vram * 100 / size)
    return f"{100 - gpu}%/{gpu}% CPU/GPU"
