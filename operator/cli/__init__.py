"""The operator's subcommands of `tokenmill`: `size` and `operator` (engine/cli/main.py dispatches here)."""
