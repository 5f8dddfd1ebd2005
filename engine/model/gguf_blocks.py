"""GGUF quantization blocks -> the integers they hold, and those integers -> the kernels' panel layouts.

decode_* read a tensor's raw blocks (rows of bytes, one row per weight row) into per-weight codes and
per-block scales, following gguf-py's dequantize_blocks for each type; the weights are never formed. The
value of weight (row, k) is then, in float32 and with one rounding,

    w = (d[k / group] * sc[k / block]) * (q[k] - offset) - dmin[k / group] * mn[k / block]

(Q4_0 / Q4_1 / Q8_0: sc = 1, group = block = 32), which is what gguf-py computes (every product of an
fp16 scale and a small integer is exact in float32; Q6_K's one inexact product is rounded once in both).
tests/test_gguf_blocks.py checks every type against gguf-py's dequantize bit for bit.

pack_* lay those integers out in panels of 16 rows (engine/layers/grouped_codes.py has the layouts),
row chunk by row chunk, so that a tensor's integers are never all held at once.
"""

import numpy as np
from tokenmill.engine.quant_memory import CODES_GGUF, GROUPED_GGUF, GroupedFormat

PANEL = 16


def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block: [rows, blocks]."""
    return np.ascontiguousarray(raw[..., start : start + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray, halves: int) -> np.ndarray:
    """[.., n] bytes -> [.., 2n] codes: the low nibbles of `halves` consecutive groups of n / halves bytes,
    then their high nibbles (GGUF's Q4/Q5 order: weights l and l + 16 share a byte in a 32-block)."""
    shape = qs.shape
    g = qs.reshape(*shape[:-1], halves, 1, shape[-1] // halves)
    out = np.concatenate([g & 0x0F, g >> 4], axis=-2)
    return out.reshape(*shape[:-1], 2 * shape[-1])


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    """[rows, row_bytes] -> [rows, blocks, block_bytes]."""
    return raw.reshape(raw.shape[0], -1, block_bytes)


def _q4k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins per super-block -> ([.., 8], [.., 8])."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode_codes(type_name: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0 / Q4_1 / Q8_0 rows -> (codes [rows, K] uint8 (Q8_0: int8), scales, mins [rows, K / 32] float32)."""
    rows = raw.shape[0]
    if type_name == "Q8_0":
        b = _blocks(raw, 34)
        d = _f16(b, 0).astype(np.float32)
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1)
        return q, d, np.zeros_like(d)
    if type_name == "Q4_0":
        b = _blocks(raw, 18)
        d = _f16(b, 0).astype(np.float32)
        return _nibbles(b[..., 2:], 1).reshape(rows, -1), d, d * np.float32(-8)
    if type_name == "Q4_1":
        b = _blocks(raw, 20)
        d, m = _f16(b, 0).astype(np.float32), _f16(b, 2).astype(np.float32)
        return _nibbles(b[..., 4:], 1).reshape(rows, -1), d, m
    raise ValueError(f"{type_name} is not a codes-layout type ({', '.join(CODES_GGUF)})")


def decode_grouped(type_name: str, raw: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K / Q6_K / Q5_0 / Q5_1 rows -> (q uint8 [rows, K], sc int8 [rows, K / block], mn int8 or
    None, d float16 [rows, K / group], dmin float16 or None), for GROUPED_GGUF[type_name]."""
    rows = raw.shape[0]
    if type_name in ("Q4_K", "Q5_K"):
        b = _blocks(raw, 144 if type_name == "Q4_K" else 176)
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, mn = _q4k_scales(b[..., 4:16])
        if type_name == "Q4_K":
            q = _nibbles(b[..., 16:], 4)  # 4 chunks of 32 bytes: weights 64i + l (low), 64i + 32 + l (high)
        else:
            q = _nibbles(b[..., 48:], 4)
            qh = b[..., 16:48]  # bit h of byte l: the fifth bit of weight 32h + l
            q = q | (((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4).reshape(q.shape)
        return (q.reshape(rows, -1), sc.reshape(rows, -1).view(np.int8), mn.reshape(rows, -1).view(np.int8),
                d.reshape(rows, -1), dmin.reshape(rows, -1))  # fmt: skip
    if type_name == "Q6_K":
        b = _blocks(raw, 210)
        ql, qh = b[..., :128], b[..., 128:192]
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
        d = _f16(b, 208)
        # ql: two halves of 64 bytes: weights 128h + l (low nibble), 128h + 64 + l (high); qh: two halves
        # of 32 bytes, bits 2t..2t+1 of byte l the top bits of weight 128h + 32t + l.
        low = _nibbles(ql, 2)
        high = ((qh.reshape(*qh.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3)
        q = low | (high.reshape(low.shape) << 4)
        return q.reshape(rows, -1), sc.reshape(rows, -1), None, d.reshape(rows, -1), None
    if type_name in ("Q5_0", "Q5_1"):
        b = _blocks(raw, 22 if type_name == "Q5_0" else 24)
        start = 2 if type_name == "Q5_0" else 4
        qh = np.ascontiguousarray(b[..., start : start + 4]).view(np.uint32)  # bit i: weight i's fifth bit
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = _nibbles(b[..., start + 4 :], 1) | (high << 4)
        d = _f16(b, 0)
        ones = np.ones(d.shape, dtype=np.int8)
        if type_name == "Q5_0":
            return q.reshape(rows, -1), ones.reshape(rows, -1), None, d.reshape(rows, -1), None
        # w = d q + m = (d * 1) q - (-m) * 1
        return (q.reshape(rows, -1), ones.reshape(rows, -1), ones.reshape(rows, -1), d.reshape(rows, -1),
                (-_f16(b, 2)).reshape(rows, -1))  # fmt: skip
    raise ValueError(f"{type_name} is not a grouped-layout type ({', '.join(GROUPED_GGUF)})")


def dequantize_reference(fmt: GroupedFormat, q, sc, mn, d, dmin) -> np.ndarray:
    """The float32 weights decode_grouped's integers stand for, in the module docstring's arithmetic
    (numpy; the tests' reference for the kernels)."""
    rows, k = q.shape
    scale = np.repeat(d.astype(np.float32), fmt.group // fmt.block, axis=1) * sc.astype(np.float32)
    w = np.repeat(scale, fmt.block, axis=1) * (q.astype(np.float32) - np.float32(fmt.offset))
    if fmt.has_min:
        low = np.repeat(dmin.astype(np.float32), fmt.group // fmt.block, axis=1) * mn.astype(np.float32)
        w = w - np.repeat(low, fmt.block, axis=1)
    return w.reshape(rows, k)


# --- panels -----------------------------------------------------------------------------------------


def to_panels(a: np.ndarray) -> np.ndarray:
    """[R, C] (R a multiple of 16, or the tensor's last rows: zero-padded) -> [R / 16, C, 16]."""
    pad = -a.shape[0] % PANEL
    if pad:
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), dtype=a.dtype)])
    return np.ascontiguousarray(a.reshape(-1, PANEL, a.shape[1]).transpose(0, 2, 1))


def nibble_panels(q: np.ndarray) -> np.ndarray:
    """Codes [R, K] (low 4 bits used) -> uint8 [R / 16, K / 2, 16]: row j of a panel holds k = 2j in the
    low and k = 2j + 1 in the high nibble (the layout of engine/layers/linear.py's nibble_codes)."""
    p = to_panels(q & 0x0F)
    return np.ascontiguousarray(p[:, 0::2, :] | (p[:, 1::2, :] << 4))


def bit_planes(q: np.ndarray, planes: int) -> np.ndarray:
    """Codes [R, K] -> uint32 [R / 16, K / 2, planes]: plane h of row pair j has bit 2c + e set when code
    (k = 2j + e, column c) has bit 4 + h (the bf16 kernel's vpermw index words, in order)."""
    p = to_panels(q)  # [P, K, 16]
    out = np.empty((p.shape[0], p.shape[1] // 2, planes), dtype=np.uint32)
    for h in range(planes):
        bits = ((p >> (4 + h)) & 1).reshape(p.shape[0], p.shape[1] // 2, 2, PANEL).transpose(0, 1, 3, 2)
        packed = np.packbits(np.ascontiguousarray(bits).reshape(p.shape[0], p.shape[1] // 2, 32), axis=-1, bitorder="little")
        out[..., h] = np.ascontiguousarray(packed).view("<u4")[..., 0]
    return out
