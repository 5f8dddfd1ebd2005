"""`tokenmill download URI [--revision REV]`: fetch a model into the cache the engine reads, and print
its local folder (what `serve` would load). The same resolution as `serve --model URI`: only the files
the engine loads, resumed, nothing fetched that the cache already holds (model/resolve.py)."""

import argparse
import sys


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="tokenmill download",
        description="Download a model (hf://ORG/NAME[@REVISION] or ORG/NAME; other sources are checked) into "
        "the Hugging Face cache (HF_HOME, HF_HUB_CACHE) from HF_ENDPOINT with HF_TOKEN; prints its folder.",
    )
    p.add_argument("model", help="hf://ORG/NAME[@REVISION], ORG/NAME, pvc://, file://, bundled:// or a path")
    p.add_argument("--revision", default=None, help="branch, tag or commit sha (default: main)")
    p.add_argument("--config-only", action="store_true", help="fetch config.json alone")
    args = p.parse_args(argv)

    from tokenmill.engine.model.resolve import resolve_model
    from tokenmill.engine.model.source import ModelSourceError

    try:
        path = resolve_model(args.model, args.revision, config_only=args.config_only, progress=True)
    except (ModelSourceError, OSError) as e:
        print(f"tokenmill download: error: {e}", file=sys.stderr, flush=True)
        return 1
    print(path, flush=True)
    return 0
