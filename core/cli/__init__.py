"""The `corral` command line (`corral.cli:main`)."""

from corral.cli.commands import main

__all__ = ["main"]
