"""The ``graphmode`` command."""

from graphmode.cli.main import main

__all__ = ["main"]
