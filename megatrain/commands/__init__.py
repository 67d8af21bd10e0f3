"""Subcommands of the `megatrain` CLI, one module each (see megatrain/cli.py)."""
