"""The operator's subcommands of `tokenmill`: `size` and `operator` (engine/cli.py dispatches here)."""
