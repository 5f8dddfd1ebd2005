"""`tokenmill` command line: dispatches each subcommand to the module that owns it.

Imports happen per subcommand so that `tokenmill size` and `tokenmill operator` run in the operator
image, which has no torch.
"""

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("tokenmill.engine.cli.serve", "run serve: the OpenAI-compatible server"),
    "download": ("tokenmill.engine.cli.download", "download a model (hf://ORG/NAME[@REV]) into the cache"),
    "generate": ("tokenmill.engine.cli.generate", "print a completion from a model"),
    "bench": ("tokenmill.engine.cli.bench", "benchmarks: throughput, serve, compare"),
    "size": ("tokenmill.operator.cli.size", "print the KV-memory sizing plan for a model on a GPU"),
    "operator": ("tokenmill.operator.cli.run", "run the Kubernetes operator"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:
        from importlib.metadata import version

        print(f"tokenmill {version('tokenmill')}")  # the installed distribution's (pyproject.toml) version
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        lines = [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
        print("usage: tokenmill <command> [options]\n\ncommands:\n" + "\n".join(lines))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\ntokenmill: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
