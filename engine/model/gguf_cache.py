"""GGUF files converted once into Hugging Face folders under the cache, keyed by the file's content (its
sha256) and the converter's version; a crash never leaves a half folder (temp dir + rename).

The folder holds config.json, the tokenizer and `model.gguf`, a link to the file itself: the engine
loads the weights from the file's blocks (model/gguf_weights.py), so the cache costs kilobytes, not 4
bytes per parameter. The same content under another path (another venv) relinks the folder to the file
that asked. dequantized_copy_cached writes the fp32 safetensors copy parity tests compare against.
"""

import hashlib
import os
import pathlib
import shutil
import tempfile
import time

from tokenmill.engine.model.cache_dirs import cache_root, tokenmill_cache

# Bump when the converter's output changes, so stale caches are not reused (3: weights linked, not copied).
CONVERTER_VERSION = 3
# The fp32 reference copy (dequantized_copy_cached): its own key, unchanged since version 2.
DEQUANTIZED_VERSION = "fp32-2"
WEIGHTS_LINK = "model.gguf"  # gguf_weights.WEIGHTS_LINK (that module imports torch)
_STALE_TMP_SECONDS = 3600  # a conversion takes seconds to minutes; older temp dirs are from a crash
# A remembered digest is trusted only for a file whose inode changed (st_ctime) this long before the digest
# was taken: file times tick coarsely (a few ms) and may come from another clock (a network filesystem).
_RACY_NS = 2_000_000_000


def gguf_cache_dir(gguf_path: pathlib.Path, version: object = CONVERTER_VERSION) -> pathlib.Path:
    """Where the converted form of gguf_path lives, keyed by the file's content and CONVERTER_VERSION (the
    converter's output format): the same GGUF installed in another venv or checkout (another path and
    mtime) reuses the conversion (relinked to the file that asks); a changed file or format gets a folder
    of its own."""
    key = f"{version}:{file_digest(gguf_path)}"
    return cache_root() / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def link_ok(folder: pathlib.Path, gguf_path: pathlib.Path) -> bool:
    """Whether the folder's weights link points at gguf_path."""
    try:
        return os.readlink(folder / WEIGHTS_LINK) == str(gguf_path.resolve())
    except OSError:
        return False


def file_digest(path: pathlib.Path) -> str:
    """sha256 of the file's bytes, remembered under ~/.cache/tokenmill/digests (beside the models folder,
    which holds converted models only): hashing the bundled 98 MB GGUF takes 0.07 s here, a 4 GB one
    about 3 s, once per installed copy.

    The memo is found by path, device, inode, size, mtime and ctime, and used only when the file's ctime is
    older than the memo's digest by _RACY_NS. mtime alone can be set back (`touch -r`, `cp -p`, `rsync -t`,
    a tool restoring times) and a rewrite can keep the size; ctime cannot be set by any call: every write,
    rename over, chmod or utime moves it to now. A file changed within _RACY_NS of being hashed (or while
    it was hashed) is hashed again until its memo is older than its ctime by that margin, as git treats a
    "racily clean" index entry."""
    st = path.stat()
    where = f"{path.resolve()}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    memo = tokenmill_cache() / "digests" / hashlib.sha256(where.encode()).hexdigest()[:32]
    try:
        known, taken_ns = memo.read_text().split()
        if len(known) == 64 and st.st_ctime_ns < int(taken_ns) - _RACY_NS:
            return known
    except (OSError, ValueError):  # none, or one an earlier version wrote (a digest alone): hash again
        pass
    taken_ns = time.time_ns()  # before reading: a change while hashing leaves a ctime this memo never trusts
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    try:  # a memo only: a read-only cache just means hashing again next time
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.tmp-{os.getpid()}")
        tmp.write_text(f"{digest} {taken_ns}\n")
        os.replace(tmp, memo)
    except OSError:
        pass
    return digest


def _remove_stale_tmp(root: pathlib.Path) -> None:
    now = time.time()
    for tmp in root.glob(".*.tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)
        except FileNotFoundError:
            pass


def convert_gguf_cached(gguf_path: str | pathlib.Path) -> pathlib.Path:
    """The GGUF's folder (config, tokenizer, a link to the file), converted once into the cache."""
    gguf_path = pathlib.Path(gguf_path)
    final = _convert_once(gguf_path, CONVERTER_VERSION, weights=False)
    if not link_ok(final, gguf_path):
        _relink(final, gguf_path)
    return final


def _relink(folder: pathlib.Path, gguf_path: pathlib.Path) -> None:
    """Point the folder's link at gguf_path, atomically (a reader sees the old link or the new one; both
    name files of the same content, as the folder's key is the content)."""
    tmp = folder / f".{WEIGHTS_LINK}.tmp-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(gguf_path.resolve(), tmp)
    os.replace(tmp, folder / WEIGHTS_LINK)


def dequantized_copy_cached(gguf_path: str | pathlib.Path) -> pathlib.Path:
    """A Hugging Face folder of the GGUF's weights dequantized to fp32 safetensors (with config and
    tokenizer), written once into the cache: the reference parity tests load with transformers and with
    the engine's safetensors loader. 4 bytes per parameter."""
    return _convert_once(pathlib.Path(gguf_path), DEQUANTIZED_VERSION, weights=True)


def _convert_once(gguf_path: pathlib.Path, version: object, weights: bool) -> pathlib.Path:
    """Convert once into the cache (temp dir + rename, so a crash never leaves a half folder); reuse after."""
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    final = gguf_cache_dir(gguf_path, version)
    if (final / "config.json").is_file():
        return final
    from tokenmill.engine.model.gguf_convert import convert_gguf  # imports torch: only on a cache miss

    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(final.parent)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        convert_gguf(gguf_path, tmp, weights=weights)
        if not weights:
            os.symlink(gguf_path.resolve(), tmp / WEIGHTS_LINK)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race with another process: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
