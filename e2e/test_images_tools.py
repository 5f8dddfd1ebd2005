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


CHECK = SCRIPT.parent / "check_dockerfiles.sh"


@pytest.mark.skipif(shutil.which("go") is None, reason="the checker is built with Go (as the e2e's Go tools)")
def test_containerfiles_pass_buildkits_dockerfile_frontend(tmp_path: Path) -> None:
    """docker/*.Dockerfile through BuildKit's own frontend (`docker build --check` lint rules, conversion to
    LLB), with the default BASE and with the mmdebstrap base's; a flag BuildKit does not know fails it."""
    proc = subprocess.run(["bash", str(CHECK)], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    for name, user in (("engine", "USER 1000:1000"), ("operator", "USER 65532:65532")):
        for base in ("FROM docker.io/library/python:3.11-slim-bookworm", "FROM localhost/tokenmill-base:"):
            assert any(f"/docker/{name}.Dockerfile: ok: 0 lint warnings" in line and base in line and user in line
                       for line in lines), (name, base, proc.stdout)
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("ARG BASE=python:3.11-slim-bookworm\nFROM ${BASE}\nCOPY --chown-recursive=1000 . /src\n")
    proc = subprocess.run(["bash", str(CHECK), str(bad)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "unknown flag: --chown-recursive" in proc.stdout, proc.stdout + proc.stderr
