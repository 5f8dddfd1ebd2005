"""GGUF headers and blocks read without gguf-py (engine/gguf_header.py, engine/model/gguf_blocks.py), checked
against gguf-py itself: the tensor table of the bundled file, every type's integers rebuilding gguf-py's
dequantized values bit for bit, the panel layouts holding those integers, and quant_memory's byte counts
equal to what the loader builds."""

import struct

import numpy as np
import pytest
import torch
from tokenmill.engine import gguf_header, quant_memory
from tokenmill.engine.bench.gguf_quantize import dequantize, quantize
from tokenmill.engine.layers.grouped_codes import GroupedPackedWeight, grouped_codes
from tokenmill.engine.model import gguf_blocks
from tokenmill.engine.model.bundled import bundled_gguf_path
from tokenmill.engine.quant_memory import CODES_GGUF, GROUPED_GGUF

ALL_TYPES = sorted(GROUPED_GGUF) + sorted(CODES_GGUF)


def test_ggml_type_table_matches_gguf_py() -> None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for type_id, (name, block, size) in gguf_header.GGML_TYPES.items():
        assert GGMLQuantizationType(type_id).name == name
        assert GGML_QUANT_SIZES[GGMLQuantizationType(type_id)] == (block, size), name


def test_the_bundled_header_reads_as_gguf_py_reads_it() -> None:
    from gguf import GGUFReader

    path = bundled_gguf_path()
    ours = gguf_header.read_gguf_header(path)
    theirs = GGUFReader(str(path))
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.type_name == b.tensor_type.name and a.shape == tuple(int(d) for d in reversed(b.shape)), a.name
        assert (a.offset, a.nbytes) == (b.data_offset, b.n_bytes), a.name
    for key in ("general.architecture", "llama.block_count", "llama.embedding_length", "tokenizer.ggml.eos_token_id"):
        assert ours.get(key) == theirs.fields[key].contents(), key
    assert ours.get("tokenizer.ggml.tokens")[:3] == theirs.fields["tokenizer.ggml.tokens"].contents()[:3]
    short = gguf_header.read_gguf_header(path, keep_arrays=16)  # the operator's reading: arrays as lengths
    assert short.get("tokenizer.ggml.tokens") == 49152 and short.tensors == ours.tensors


def test_damaged_headers_are_refused_by_name(tmp_path) -> None:
    path = bundled_gguf_path()
    raw = path.read_bytes()[: gguf_header.read_gguf_header(path).data_offset + 1000]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:5000])
    with pytest.raises(gguf_header.GGUFHeaderError, match=r"cut\.gguf: file ends inside the GGUF header"):
        gguf_header.read_gguf_header(cut)
    body = tmp_path / "body.gguf"
    body.write_bytes(raw)  # the whole header, tensors missing
    with pytest.raises(gguf_header.GGUFHeaderError, match=r"body\.gguf: tensor 'token_embd.weight' spans bytes"):
        gguf_header.read_gguf_header(body)
    v1 = tmp_path / "v1.gguf"
    v1.write_bytes(b"GGUF" + struct.pack("<I", 1) + raw[8:4096])
    with pytest.raises(gguf_header.GGUFHeaderError, match=r"GGUF version 1 is not supported; supported: 2, 3"):
        gguf_header.read_gguf_header(v1)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGML" + raw[4:4096])
    with pytest.raises(gguf_header.GGUFHeaderError, match=r"junk\.gguf is not a GGUF file"):
        gguf_header.read_gguf_header(junk)


def _weights(rows: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, k)).astype(np.float32) * 0.05
    w[:, :32] += 0.3  # a sub-block with no negative weight: Q4_K's min 0 path
    w[1] = 0.0  # an all-zero row
    return w


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_decoded_integers_rebuild_gguf_py_values_bit_for_bit(type_name) -> None:
    raw = quantize(_weights(20, 512, 1), type_name)
    expect = dequantize(raw, type_name)
    if type_name in GROUPED_GGUF:
        got = gguf_blocks.dequantize_reference(GROUPED_GGUF[type_name], *gguf_blocks.decode_grouped(type_name, raw))
    else:
        q, s, m = gguf_blocks.decode_codes(type_name, raw)
        # One rounding of scale * code + min, as the fp32 kernels' fused multiply-add does.
        got = (np.repeat(s, 32, 1).astype(np.float64) * q + np.repeat(m, 32, 1)).astype(np.float32)
    assert np.array_equal(got, expect)  # -0.0 == 0.0: Q4_0's d * (8 - 8) has either sign


@pytest.mark.parametrize("type_name", sorted(GROUPED_GGUF))
def test_random_block_bits_decode_as_gguf_py_does(type_name) -> None:
    """Every bit of the code and scale bytes exercised (not only what a quantizer writes): random bytes
    with the fp16 fields set to sane values."""
    rng = np.random.default_rng(7)
    raw = quantize(_weights(16, 256, 2), type_name)
    noise = rng.integers(0, 256, raw.shape, dtype=np.uint8)
    keep = np.zeros(raw.shape[1], dtype=bool)
    block_bytes = gguf_header.GGML_TYPES[next(i for i, v in gguf_header.GGML_TYPES.items() if v[0] == type_name)][2]
    fp16_fields = {"Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 210), "Q5_0": (0, 2), "Q5_1": (0, 4)}[type_name]
    for b in range(0, raw.shape[1], block_bytes):
        keep[b + fp16_fields[0] : b + fp16_fields[1]] = True
    raw = np.where(keep, raw, noise)
    expect = dequantize(raw, type_name)
    got = gguf_blocks.dequantize_reference(GROUPED_GGUF[type_name], *gguf_blocks.decode_grouped(type_name, raw))
    assert np.array_equal(got, expect)


def _grouped(type_name: str, raw: np.ndarray) -> GroupedPackedWeight:
    from tokenmill.engine.model.gguf_weights import _grouped_panels

    a = {k: torch.from_numpy(v) for k, v in _grouped_panels(type_name, raw).items()}
    e8, e16 = torch.empty(0, dtype=torch.int8), torch.empty(0, dtype=torch.float16)
    return GroupedPackedWeight(raw.shape[0], GROUPED_GGUF[type_name], a["lo"], a["hi"].view(torch.int32), a["sc"],
                               a.get("mn", e8), a["d"], a.get("dmin", e16))  # fmt: skip


@pytest.mark.parametrize("type_name", sorted(GROUPED_GGUF))
def test_panels_hold_the_codes_and_torch_dequantizes_them_exactly(type_name) -> None:
    raw = quantize(_weights(37, 512, 3), type_name)  # 37 rows: a padded last panel
    q = gguf_blocks.decode_grouped(type_name, raw)[0]
    w = _grouped(type_name, raw)
    assert torch.equal(grouped_codes(w)[:37], torch.from_numpy(q.astype(np.int32)))
    assert not grouped_codes(w)[37:].any()
    assert torch.equal(w.dequantize(), torch.from_numpy(dequantize(raw, type_name)))
    assert w.nbytes == quant_memory.grouped_bytes(GROUPED_GGUF[type_name], 37, 512)


@pytest.mark.parametrize("type_name", sorted(CODES_GGUF))
@pytest.mark.parametrize("half", [False, True])
def test_codes_layout_bytes_are_what_quant_memory_counts(type_name, half) -> None:
    from tokenmill.engine.model.gguf_weights import _codes_panels

    raw = quantize(_weights(37, 256, 4), type_name)
    size = sum(a.nbytes for a in _codes_panels(type_name, raw, half).values())
    assert size == quant_memory.codes_bytes(CODES_GGUF[type_name], 37, 256, half)


def test_bytes_per_weight_of_the_formats() -> None:
    """The figures docs/engine.md quotes, from quant_memory's count of a 4096 x 4096 weight."""
    per = {t: quant_memory.grouped_bytes(f, 4096, 4096) / 4096**2 for t, f in GROUPED_GGUF.items()}
    assert per["Q4_K"] == 0.578125 and per["Q5_K"] == 0.703125 and per["Q6_K"] == 0.8203125
    assert quant_memory.codes_bytes(4, 4096, 4096, True) / 4096**2 == 0.625
    assert quant_memory.grouped_bytes(quant_memory.int4_group_format(128), 4096, 4096) / 4096**2 == 0.59375
