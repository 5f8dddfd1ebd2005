"""A local stand-in for the Hugging Face Hub, serving the subset of the Hub HTTP API that huggingface_hub uses.

No hub is reachable from CI, so this is the one stand-in: the real `huggingface_hub` client (and anything
built on it: the engine's model sources, the operator's hub sizing) talks to it through `HF_ENDPOINT`.
It serves repos from local folders (tiny test models from tests/tiny_models.py), stdlib only, so it runs
in any Python process: a test thread, or an e2e pod (`python tests/hub_standin.py ...`).

Served (what `snapshot_download`, `hf_hub_download` and `HfApi().model_info(files_metadata=True)` call):
- `GET /api/models/ORG/NAME[/revision/REV][?blobs=true]`: model info (`sha`, `gated`, `siblings` with
  `size`/`blobId`/`lfs` when blobs=true, `config.architectures`, `safetensors` parameter counts).
- `GET /api/models/ORG/NAME/tree/REV[/PATH]?recursive=...`: the file listing (LFS entries for safetensors).
- `HEAD|GET /ORG/NAME/resolve/REV/PATH`: the file, with `ETag` (git blob sha1; sha256 for LFS files),
  `X-Repo-Commit`, `Content-Length`, `Accept-Ranges`; `Range: bytes=A-[B]` answers 206 (resume).
- Revisions: branches, tags, full commit shas. Every `add_repo` call is a new commit; it moves `branch`.
- Errors with the Hub's `X-Error-Code`/`X-Error-Message` headers, so the client raises its own types:
  unknown repo -> 404 RepoNotFound (RepositoryNotFoundError); unknown revision -> 404 RevisionNotFound
  (RevisionNotFoundError); unknown file -> 404 EntryNotFound (RemoteEntryNotFoundError); a gated repo's
  files without a token -> 401 GatedRepo, with a token not granted -> 403 GatedRepo (GatedRepoError).
  As on the Hub, a gated repo's info and listing stay public; only `resolve` needs the token.
- `GET /_standin/requests`: the request log as JSON (for tests that run the stand-in as a process).

Python API:
    hub = HubStandin(); hub.start()                  # or `with HubStandin() as hub:`; hub.url for HF_ENDPOINT
    sha = hub.add_repo("tiny/llama", folder, tags=("v1",), gated=False, tokens=("hf_x",))
    hub.downloads("tiny/llama", "model.safetensors") # GETs of that file (HEADs are not downloads)
    hub.requests(repo_id=None, method=None)          # the RequestRecord log, filtered
    hub.cut_next_get("tiny/llama", "model.safetensors", after_bytes=1000)  # drop the connection mid-file once
    hub.reset_log(); hub.stop()

Process:
    python tests/hub_standin.py --root DIR --port P [--host H] [--gated ORG/NAME] [--token T] [--tag ORG/NAME=TAG]
  Every DIR/ORG/NAME folder holding a config.json becomes repo ORG/NAME (branch main). Prints one JSON
  line `{"url": ..., "repos": {"ORG/NAME": "<commit sha>"}}` once it listens, then serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import re
import signal
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

_LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")  # stored in LFS on the Hub
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_CHUNK = 1 << 16
_MAX_HEADER = 100 << 20  # the safetensors format's limit on its JSON header


@dataclass(frozen=True)
class HubFile:
    path: str  # inside the repo, '/'-separated
    local: pathlib.Path
    size: int
    git_sha1: str  # what git would name the blob
    sha256: str | None  # LFS files only

    @property
    def etag(self) -> str:
        return self.sha256 or self.git_sha1


@dataclass
class HubRepo:
    repo_id: str
    gated: bool = False
    tokens: frozenset[str] = frozenset()
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)  # sha -> path -> file
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> sha


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str  # URL path, unquoted
    repo_id: str | None
    filename: str | None  # resolve requests only
    range: str | None
    authorization: bool
    status: int
    user_agent: str = ""  # the client's name first: "tokenmill/0.1.0; hf_hub/..." or "tokenmill-operator/..."


def _hash_file(path: pathlib.Path, lfs: bool) -> tuple[str, str | None]:
    size = path.stat().st_size
    git = hashlib.sha1(f"blob {size}\0".encode())
    sha = hashlib.sha256() if lfs else None
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            git.update(chunk)
            if sha is not None:
                sha.update(chunk)
    return git.hexdigest(), sha.hexdigest() if sha else None


def _safetensors_parameters(path: pathlib.Path) -> dict[str, int]:
    """dtype -> element count, from the file's JSON header (what the Hub reports as `safetensors`)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else 0
        if not 0 < n <= min(_MAX_HEADER, path.stat().st_size - 8):
            return {}  # not a safetensors file: the Hub reports nothing for it either
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return {}
    out: dict[str, int] = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for d in t["shape"]:
            count *= d
        out[t["dtype"]] = out.get(t["dtype"], 0) + count
    return out


class HubStandin:
    """The stand-in server. Thread-safe; start() binds a free port unless one is given."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self.port = host, port
        self.repos: dict[str, HubRepo] = {}
        self._log: list[RequestRecord] = []
        self._cuts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- setup ---------------------------------------------------------------------------------
    def add_repo(
        self,
        repo_id: str,
        folder: str | pathlib.Path,
        *,
        branch: str = "main",
        tags: tuple[str, ...] = (),
        gated: bool = False,
        tokens: tuple[str, ...] = (),
    ) -> str:
        """Commit `folder`'s files (read in place: do not change them afterwards) to `branch`; returns the sha."""
        folder = pathlib.Path(folder)
        files: dict[str, HubFile] = {}
        for p in sorted(folder.rglob("*")):
            if not p.is_file():
                continue
            rel = p.relative_to(folder).as_posix()
            lfs = rel.endswith(_LFS_SUFFIXES)
            git_sha1, sha256 = _hash_file(p, lfs)
            files[rel] = HubFile(rel, p, p.stat().st_size, git_sha1, sha256)
        with self._lock:
            repo = self.repos.setdefault(repo_id, HubRepo(repo_id))
            parent = repo.refs.get(branch, "")
            digest = hashlib.sha1(f"{repo_id}\0{parent}".encode())
            for f in files.values():
                digest.update(f"{f.path}\0{f.git_sha1}\0".encode())
            sha = digest.hexdigest()
            repo.commits[sha] = files
            repo.refs[branch] = sha
            for tag in tags:
                repo.refs[tag] = sha
            repo.gated = repo.gated or gated
            repo.tokens = repo.tokens | frozenset(tokens)
        return sha

    # ---- observation ---------------------------------------------------------------------------
    def requests(self, repo_id: str | None = None, method: str | None = None) -> list[RequestRecord]:
        with self._lock:
            return [
                r
                for r in self._log
                if (repo_id is None or r.repo_id == repo_id) and (method is None or r.method == method)
            ]

    def downloads(self, repo_id: str, filename: str) -> int:
        """How many GETs of this file's content were answered (200 or 206)."""
        return sum(
            1 for r in self.requests(repo_id, "GET") if r.filename == filename and r.status in (200, 206)
        )

    def reset_log(self) -> None:
        with self._lock:
            self._log.clear()

    def cut_next_get(self, repo_id: str, filename: str, after_bytes: int) -> None:
        """The next GET of this file sends its full Content-Length but only `after_bytes`, then hangs up."""
        with self._lock:
            self._cuts[(repo_id, filename)] = after_bytes

    # ---- lifecycle -----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> HubStandin:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer((self.host, self.port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-standin", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> HubStandin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- used by the handler -------------------------------------------------------------------
    def _record(self, rec: RequestRecord) -> None:
        with self._lock:
            self._log.append(rec)

    def _take_cut(self, repo_id: str, filename: str) -> int | None:
        with self._lock:
            return self._cuts.pop((repo_id, filename), None)


class _HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


class _Handler(BaseHTTPRequestHandler):
    hub: HubStandin
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects

    def log_message(self, format: str, *args: object) -> None:  # quiet: tests read the request log instead
        pass

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_GET(self) -> None:
        self._dispatch("GET")

    # ---- routing -------------------------------------------------------------------------------
    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        query = parse_qs(url.query)
        self._repo_id = self._filename = None
        status = 500
        try:
            if path == "/_standin/requests":
                status = self._send_json([r.__dict__ for r in self.hub.requests()], method)
            elif path.startswith("/api/models/"):
                status = self._api(path.removeprefix("/api/models/"), query, method)
            elif "/resolve/" in path:
                status = self._resolve(path.lstrip("/"), method)
            else:
                raise _HubError(404, None, "Not Found")
        except _HubError as e:
            status = e.status
            self._send_error(e, method)
        except (BrokenPipeError, ConnectionResetError):
            status = 499  # the client went away
        finally:
            self.hub._record(
                RequestRecord(
                    method=method,
                    path=path,
                    repo_id=self._repo_id,
                    filename=self._filename,
                    range=self.headers.get("Range"),
                    authorization=bool(self.headers.get("Authorization")),
                    status=status,
                    user_agent=self.headers.get("User-Agent", ""),
                )
            )

    def _repo(self, repo_id: str) -> HubRepo:
        self._repo_id = repo_id
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            raise _HubError(404, "RepoNotFound", "Repository not found")
        return repo

    @staticmethod
    def _commit(repo: HubRepo, revision: str) -> str:
        if revision in repo.refs:
            return repo.refs[revision]
        if _COMMIT.match(revision) and revision in repo.commits:
            return revision
        raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")

    def _api(self, rest: str, query: dict, method: str) -> int:
        parts = rest.split("/")
        repo = self._repo("/".join(parts[:2]))
        tail = parts[2:]
        if not tail:
            return self._model_info(repo, repo.refs.get("main") or next(iter(repo.commits)), query, method)
        if tail[0] == "revision" and len(tail) >= 2:
            return self._model_info(repo, self._commit(repo, "/".join(tail[1:])), query, method)
        if tail[0] == "tree" and len(tail) >= 2:
            sha = self._commit(repo, tail[1])
            prefix = "/".join(tail[2:]).strip("/")
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            return self._send_json(self._tree(repo.commits[sha], prefix, recursive), method)
        raise _HubError(404, None, "Not Found")

    def _model_info(self, repo: HubRepo, sha: str, query: dict, method: str) -> int:
        files = repo.commits[sha]
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for f in files.values():
            s: dict = {"rfilename": f.path}
            if blobs:
                s.update(size=f.size, blobId=f.git_sha1)
                if f.sha256:
                    s["lfs"] = {"size": f.size, "sha256": f.sha256, "pointerSize": 134}
            siblings.append(s)
        info: dict = {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": sha,
            "private": False,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "tags": ["transformers", "safetensors"],
            "library_name": "transformers",
            "siblings": siblings,
        }
        config = files.get("config.json")
        if config is not None:
            data = json.loads(config.local.read_bytes())
            info["config"] = {k: data[k] for k in ("architectures", "model_type") if k in data}
        params: dict[str, int] = {}
        for f in files.values():
            if f.path.endswith(".safetensors"):
                for dtype, n in _safetensors_parameters(f.local).items():
                    params[dtype] = params.get(dtype, 0) + n
        if params:
            info["safetensors"] = {"parameters": params, "total": sum(params.values())}
        return self._send_json(info, method)

    @staticmethod
    def _tree(files: dict[str, HubFile], prefix: str, recursive: bool) -> list[dict]:
        out: list[dict] = []
        dirs: set[str] = set()
        for f in files.values():
            if prefix and not f.path.startswith(prefix + "/"):
                continue
            rel = f.path[len(prefix) + 1 :] if prefix else f.path
            parts = rel.split("/")
            for i in range(1, len(parts)):
                if recursive or i == 1:
                    dirs.add("/".join(([prefix] if prefix else []) + parts[:i]))
            if len(parts) > 1 and not recursive:
                continue
            entry: dict = {"type": "file", "oid": f.git_sha1, "size": f.size, "path": f.path}
            if f.sha256:
                entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
            out.append(entry)
        for d in sorted(dirs):
            out.append(
                {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
            )
        return out

    def _resolve(self, rest: str, method: str) -> int:
        head, _, tail = rest.partition("/resolve/")
        repo = self._repo(head)
        revision, _, filename = tail.partition("/")
        self._filename = filename
        sha = self._commit(repo, revision)
        f = repo.commits[sha].get(filename)
        if f is None:
            raise _HubError(404, "EntryNotFound", "Entry not found", commit=sha)
        if repo.gated:
            auth = self.headers.get("Authorization", "")
            token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
            if not token:
                raise _HubError(
                    401,
                    "GatedRepo",
                    f"Access to model {repo.repo_id} is restricted. You must have access to it and be "
                    "authenticated to access it. Please log in.",
                )
            if token not in repo.tokens:
                raise _HubError(
                    403,
                    "GatedRepo",
                    f"Access to model {repo.repo_id} is restricted and you are not in the authorized list. "
                    f"Visit {self.hub.url}/{repo.repo_id} to ask for access.",
                )
        return self._send_file(f, sha, method)

    # ---- responses -----------------------------------------------------------------------------
    def _send_json(self, data: object, method: str) -> int:
        body = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if method == "GET":
            self.wfile.write(body)
        return 200

    def _send_error(self, e: _HubError, method: str) -> None:
        body = json.dumps({"error": e.message}).encode()
        self.send_response(e.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if e.code:
            self.send_header("X-Error-Code", e.code)
        self.send_header("X-Error-Message", e.message)
        if e.commit:
            self.send_header("X-Repo-Commit", e.commit)
        self.end_headers()
        if method == "GET":
            self.wfile.write(body)

    def _send_file(self, f: HubFile, sha: str, method: str) -> int:
        start, end = 0, f.size - 1
        status = 200
        rng = self.headers.get("Range")
        if rng:
            m = _RANGE.match(rng.strip())
            if not m or int(m.group(1)) >= max(f.size, 1):
                raise _HubError(416, None, f"Range Not Satisfiable: {rng} for {f.size} bytes")
            start = int(m.group(1))
            end = min(int(m.group(2)), f.size - 1) if m.group(2) else f.size - 1
            status = 206
        length = end - start + 1
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{f.etag}"')
        self.send_header("X-Repo-Commit", sha)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{f.size}")
        self.end_headers()
        if method != "GET":
            return status
        cut = self.hub._take_cut(self._repo_id or "", f.path)
        remaining = length if cut is None else min(cut, length)
        with open(f.local, "rb") as src:
            src.seek(start)
            while remaining > 0:
                chunk = src.read(min(_CHUNK, remaining))
                if not chunk:
                    break
                self.wfile.write(chunk)
                remaining -= len(chunk)
        if cut is not None:
            self.wfile.flush()
            self.close_connection = True
            self.connection.close()  # the client sees a body shorter than Content-Length
        return status


def _serve_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="hub_standin", description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True, help="folder of ORG/NAME model folders")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--gated", action="append", default=[], help="ORG/NAME to serve as gated (repeatable)")
    p.add_argument("--token", action="append", default=[], help="a token granted access to the gated repos")
    p.add_argument("--tag", action="append", default=[], help="ORG/NAME=TAG: tag main's commit (repeatable)")
    args = p.parse_args(argv)
    hub = HubStandin(args.host, args.port)
    tags: dict[str, list[str]] = {}
    for t in args.tag:
        repo_id, _, tag = t.partition("=")
        tags.setdefault(repo_id, []).append(tag)
    shas = {}
    for config in sorted(pathlib.Path(args.root).glob("*/*/config.json")):
        repo_id = config.parent.relative_to(args.root).as_posix()
        shas[repo_id] = hub.add_repo(
            repo_id,
            config.parent,
            tags=tuple(tags.get(repo_id, ())),
            gated=repo_id in args.gated,
            tokens=tuple(args.token),
        )
    hub.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(json.dumps({"url": hub.url, "repos": shas}), flush=True)
    while not stop.is_set():
        time.sleep(0.2)
    hub.stop()
    return 0


if __name__ == "__main__":
    sys.exit(_serve_main(sys.argv[1:]))
