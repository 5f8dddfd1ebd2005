"""`tokenmill` subcommands, one module each (`main.py` dispatches). Runs in the process the user starts.

May import any engine package; nothing imports cli/ (the server, the benchmarks and the operator are
started from here, not the other way round).
"""

from tokenmill.engine.cli.main import main

__all__ = ["main"]
