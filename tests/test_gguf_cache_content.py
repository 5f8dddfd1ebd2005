"""The GGUF conversion cache (engine/model/gguf_cache.py) is keyed by the file's sha256; the remembered
digest stands in for hashing only while the file's inode is untouched since well before it was taken, so a
GGUF rewritten under the same size and mtime is hashed again and finds (or makes) its own conversion."""

import hashlib
import os
import time

import pytest
from tokenmill.engine.model import gguf_cache
from tokenmill.engine.model.gguf_convert import GGUFError

FAKE = "f" * 64  # a digest no file here has: returned only when a memo is trusted


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def memos(tmp_path) -> list:
    return sorted((tmp_path / "cache" / "tokenmill" / "digests").iterdir())


def test_a_rewrite_in_place_under_the_same_size_and_mtime_is_hashed_again(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF first bytes")
    before = gguf_cache.gguf_cache_dir(path)
    st = path.stat()
    with open(path, "r+b") as f:  # the same inode, the same size
        f.write(b"GGUF other bytes")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns, path.stat().st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    assert gguf_cache.file_digest(path) == hashlib.sha256(b"GGUF other bytes").hexdigest()
    assert gguf_cache.gguf_cache_dir(path) != before


def test_a_settled_files_memo_is_used_and_a_replaced_file_is_not_answered_from_it(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF first bytes")
    real_ns = time.time_ns
    # The digest is taken 10 s after the file's last change, as for any file installed a while ago.
    monkeypatch.setattr(gguf_cache.time, "time_ns", lambda: real_ns() + 10_000_000_000)
    assert gguf_cache.file_digest(path) == hashlib.sha256(b"GGUF first bytes").hexdigest()
    (memo,) = memos(tmp_path)
    taken = memo.read_text().split()[1]
    memo.write_text(f"{FAKE} {taken}\n")
    assert gguf_cache.file_digest(path) == FAKE  # trusted: the file did not change since
    # Other bytes of the same size put in place by rename (what cp, rsync and downloads do), mtime kept.
    st = path.stat()
    tmp = tmp_path / "m.gguf.part"
    tmp.write_bytes(b"GGUF other bytes")
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, path)
    assert gguf_cache.file_digest(path) == hashlib.sha256(b"GGUF other bytes").hexdigest()


def test_a_memo_taken_just_after_a_change_is_not_trusted(tmp_path):
    """Within _RACY_NS of the file's last change its ctime may not have ticked yet for a second change;
    such a memo is not used, so the file is hashed again (and the memo retaken)."""
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF first bytes")
    real = gguf_cache.file_digest(path)
    (memo,) = memos(tmp_path)
    memo.write_text(f"{FAKE} {memo.read_text().split()[1]}\n")
    assert gguf_cache.file_digest(path) == real
    assert memo.read_text().split()[0] == real


def test_a_memo_an_earlier_version_wrote_is_hashed_again(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF bytes")
    real_ns = time.time_ns
    monkeypatch.setattr(gguf_cache.time, "time_ns", lambda: real_ns() + 10_000_000_000)
    real = gguf_cache.file_digest(path)
    (memo,) = memos(tmp_path)
    memo.write_text(FAKE + "\n")  # a digest alone: no time it was taken
    assert gguf_cache.file_digest(path) == real


def test_a_conversion_under_the_old_path_and_mtime_key_is_not_adopted(tmp_path):
    """Earlier versions filed conversions by path, size and mtime; such a folder may be of other bytes,
    so it is left alone and the file is converted (here: refused, it is no GGUF)."""
    path = tmp_path / "m.gguf"
    path.write_bytes(b"not a real GGUF: converting it fails")
    st = path.stat()
    key = f"{gguf_cache.CONVERTER_VERSION}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    legacy = gguf_cache.cache_root() / f"m-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    legacy.mkdir(parents=True)
    (legacy / "config.json").write_text("{}")
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        gguf_cache.convert_gguf_cached(path)
    assert (legacy / "config.json").is_file() and not gguf_cache.gguf_cache_dir(path).exists()
