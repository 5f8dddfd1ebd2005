"""The weight-block cache (engine/model/weight_codes_cache.py) serves codes only for the weights they were
found in: a source rewritten under the same size and mtime, or one byte changed in the cached file, and
the entry is refused, searched for again, and the answer equals a start without any cache."""

import json
import os
import pathlib
import struct

import pytest
import torch
from quantized_weights import quantized_weight
from safetensors.torch import load_file, save_file
from tokenmill.engine.layers.weight_codes import find_weight_codes
from tokenmill.engine.model import weight_codes_cache as wcc
from tokenmill.kernels import cpu

BUILD = "tokenmill_cpu_test"
PARTS = ("codes", "scales", "mins")


@pytest.fixture(autouse=True)
def kernels_and_cache_home(tmp_path, monkeypatch):
    if cpu.load() is None:
        pytest.skip(f"no C++ kernels on this machine: {cpu.unavailable_reason()}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def weights(seed: int) -> dict[str, torch.Tensor]:
    return {"a": quantized_weight(64, 128, "q4_1", seed), "b": quantized_weight(32, 64, "q8_0", seed + 1)}


@pytest.fixture
def model_dir(tmp_path) -> pathlib.Path:
    folder = tmp_path / "model"
    folder.mkdir()
    save_file(weights(0), str(folder / "model.safetensors"))
    return folder


def load(folder: pathlib.Path) -> torch.nn.Module:
    model = torch.nn.Module()
    for name, t in load_file(str(folder / "model.safetensors")).items():
        model.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    return model


def start(folder: pathlib.Path):
    """One start's use of the cache, as the worker does it: open, look up every weight, save."""
    model = load(folder)
    cache = wcc.open_cache(model, folder, BUILD)
    got = {n: find_weight_codes(p, cache) for n, p in model.named_parameters()}
    wcc.save_cache(cache)
    return cache, got, model


def cold(model: torch.nn.Module) -> dict:
    return {n: find_weight_codes(p) for n, p in model.named_parameters()}


def assert_same_codes(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for n in want:
        assert got[n] is not None and want[n] is not None, n
        for part in PARTS:
            assert torch.equal(getattr(got[n], part), getattr(want[n], part)), (n, part)


def test_a_warm_start_reads_back_checked_codes_equal_to_a_cold_search(model_dir):
    first, found, model = start(model_dir)
    assert first.hits == 0 and sorted(first.found) == ["a", "b"] and first.path.is_file()
    assert_same_codes(found, cold(model))
    second, got, _ = start(model_dir)
    assert second.hits == 2 and second.refused == {} and second.found == {}
    assert_same_codes(got, found)


def test_a_source_rewritten_under_the_same_size_and_mtime_is_refused(model_dir):
    _, old, _ = start(model_dir)
    source = model_dir / "model.safetensors"
    st = source.stat()
    new = weights(0)
    new["a"] = new["a"].flip(0).contiguous()  # the rows reversed: still integer blocks, other codes
    save_file(new, str(source))
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert source.stat().st_size == st.st_size and source.stat().st_mtime_ns == st.st_mtime_ns

    cache, got, model = start(model_dir)
    assert cache.path == wcc.cache_path(model_dir, BUILD)  # the file's name matched, as mtime trust did
    assert_same_codes(got, cold(model))
    assert list(cache.refused) == ["a"] and "sha256 differs" in cache.refused["a"]
    assert cache.hits == 1 and sorted(cache.found) == ["a"]
    assert not torch.equal(got["a"].codes, old["a"].codes)  # what the mtime rule would have served
    again, got_again, _ = start(model_dir)  # the file was written anew, with both entries
    assert again.hits == 2 and again.refused == {}
    assert_same_codes(got_again, got)


def tensor_span(path: pathlib.Path, key: str) -> tuple[int, int]:
    """[start, end) of a tensor's bytes in a safetensors file (8-byte header length, JSON header, data)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + n])[key]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def digest_offset(path: pathlib.Path, name: str) -> int:
    """Where the recorded digests of entry `name` start in the file's JSON header."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    recorded = json.loads(raw[8 : 8 + n])["__metadata__"][name]
    return raw.index(recorded.encode(), 8)


@pytest.mark.parametrize("where", ["a.codes", "a.scales", "a.mins", "a's source digest"])
def test_one_byte_changed_in_the_cached_file_is_refused(model_dir, where):
    first, _, model = start(model_dir)
    path = first.path
    if where.endswith("digest"):
        at = digest_offset(path, "a")
    else:
        begin, end = tensor_span(path, where)
        at = (begin + end) // 2
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))

    cache, got, _ = start(model_dir)
    assert_same_codes(got, cold(model))
    assert list(cache.refused) == ["a"], cache.refused
    assert cache.hits == 1 and sorted(cache.found) == ["a"]
    again, _, _ = start(model_dir)
    assert again.hits == 2 and again.refused == {}


def test_a_file_without_digests_is_not_trusted(model_dir):
    first, _, model = start(model_dir)
    tensors = load_file(str(first.path))
    save_file(tensors, str(first.path))  # the same codes, no recorded digests (what version 1 wrote)
    cache, got, _ = start(model_dir)
    assert cache.hits == 0 and sorted(cache.found) == ["a", "b"]
    assert_same_codes(got, cold(model))


def test_content_digest_is_one_answer_for_any_thread_count_and_sees_one_bit(monkeypatch):
    monkeypatch.setattr(wcc, "DIGEST_CHUNK", 1000)  # many chunks from a small tensor
    t = quantized_weight(64, 128, "q4_1", 7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = wcc.content_digest(t)
        torch.set_num_threads(2)
        two = wcc.content_digest(t)
    finally:
        torch.set_num_threads(threads)
    assert one == two
    flipped = t.clone()
    flipped.view(torch.int32)[63, 127] ^= 1
    assert wcc.content_digest(flipped) != one
    assert wcc.content_digest(t.reshape(128, 64)) != one  # same bytes, another shape
