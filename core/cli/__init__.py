"""The `corral` command line: `commands` (the click group), `chat` (conversations and the `>>>` session),
`backends` (answers from a server or from this process) and `display` (what it prints)."""

from corral.cli.commands import main

__all__ = ["main"]
