"""`make image-tools` (images/install_tools.sh) on a machine without podman, runc and mmdebstrap: it names
what is missing and installs Debian's packages with apt-get. Here the tools are installed (others use
them), so the missing branch runs with a PATH that lacks them and `apt-get install --simulate` (Debian's
real apt-get resolving the real package names); docs/images.md has the run in a fresh Debian chroot.
No cluster, no podman needed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "images" / "install_tools.sh"
TOOLS = ("podman", "runc", "mmdebstrap")


def path_without(tmp_path: Path, hidden: tuple[str, ...]) -> str:
    """A PATH of one folder linking every program on this PATH except `hidden`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for folder in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(folder):
            continue
        for entry in os.scandir(folder):
            link = bin_dir / entry.name
            if entry.name not in hidden and not link.exists() and os.access(entry.path, os.X_OK):
                link.symlink_to(entry.path)
    return str(bin_dir)


def run(path: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env={**os.environ, "PATH": path}, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.skipif(shutil.which("apt-get") is None, reason="apt-get (Debian) is what the script installs with")
def test_missing_tools_are_named_and_installed_from_debian(tmp_path: Path) -> None:
    proc = run(path_without(tmp_path, TOOLS), "--simulate")
    assert proc.returncode == 0, proc.stderr
    assert "[image-tools] not found: podman runc mmdebstrap; installing Debian's" in proc.stdout, proc.stdout
    # apt-get resolved every package: each is either to be installed ("Inst") or already there.
    for package in (*TOOLS, "uidmap"):
        assert any(line.startswith(f"Inst {package} ") or line.startswith(f"{package} is already")
                   for line in proc.stdout.splitlines()), (package, proc.stdout[-2000:])


def test_one_missing_tool_is_enough_and_none_missing_does_nothing(tmp_path: Path) -> None:
    if any(shutil.which(t) is None for t in TOOLS):
        pytest.skip("the tools are not installed here")
    assert run(os.environ["PATH"]).stdout == ""  # nothing missing: silent, apt-get not run
    fake = tmp_path / "fake"
    fake.mkdir()
    # Only runc missing; apt-get replaced by a recorder (this test is about the decision, the one above
    # runs Debian's apt-get).
    (fake / "apt-get").write_text('#!/bin/sh\necho "apt-get $*"\n')
    (fake / "apt-get").chmod(0o755)
    path = f"{fake}{os.pathsep}{path_without(tmp_path, ('runc', 'apt-get'))}"
    proc = run(path, "--simulate")
    assert "not found: runc;" in proc.stdout, proc.stdout
    assert "apt-get install --simulate -q --no-install-recommends podman runc mmdebstrap uidmap" in proc.stdout
