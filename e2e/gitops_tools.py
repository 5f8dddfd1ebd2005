"""The GitOps e2e checks' Go programs (built by e2e/build_gitops_tools.sh, cached by library version):
`lua-health` runs an Argo CD health script in gopher-lua, `kstatus` judges objects with cli-utils' kstatus."""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path

from cluster import REPO

BUILD_SCRIPT = REPO / "e2e" / "build_gitops_tools.sh"


@functools.cache
def _bin_dirs() -> tuple[Path, ...]:
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"{BUILD_SCRIPT.name} failed:\n{proc.stderr[-3000:]}"
    return tuple(Path(d) for d in proc.stdout.strip().splitlines()[-1].split(":"))


def binary(name: str) -> Path:
    for d in _bin_dirs():
        if (d / name).exists():
            return d / name
    raise AssertionError(f"{name} not found in {_bin_dirs()} after {BUILD_SCRIPT.name}")


def _run(argv: list[str], objs: list[dict]) -> list[dict]:
    proc = subprocess.run(argv, input=json.dumps(objs), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{argv[0]} exited {proc.returncode}: {proc.stderr}"
    out = json.loads(proc.stdout)
    assert len(out) == len(objs)
    return out


def lua_health(script: Path, objs: list[dict]) -> list[dict]:
    """Argo CD's view: [{"status": "Healthy"|"Progressing"|"Degraded"|..., "message": ...}, ...]."""
    return _run([str(binary("lua-health")), str(script)], objs)


def kstatus(objs: list[dict]) -> list[dict]:
    """Flux's and kpt's view: [{"status": "Current"|"InProgress"|"Failed"|..., "message": ...}, ...]."""
    return _run([str(binary("kstatus"))], objs)
