"""The ``hf2q-mlx`` command line and the tools behind its subcommands."""

from hf2q_mlx.cli.commands import main

__all__ = ["main"]
