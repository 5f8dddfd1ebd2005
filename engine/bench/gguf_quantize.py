"""GGUF quantization for benchmark models (quant_model.py) and test fixtures: gguf-py's quantizers where it
has them (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), and simple K-quant quantizers written here (gguf-py 0.19
dequantizes Q4_K, Q5_K and Q6_K but cannot quantize them). The K-quant blocks follow the byte layout gguf-py's dequantize_blocks reads (llama.cpp's
block_q4_K / block_q5_K / block_q6_K); the scale search is the plain min/max one, not llama.cpp's
iterative fit, so the error is larger than llama-quantize's but every block is valid. What the tests
compare against is gguf-py's dequantization of these very bytes, so the quantizer's quality does not
enter any assertion beyond a loose round-trip check.

numpy and gguf only: no CI job needs llama.cpp's llama-quantize.
"""

import numpy as np

QK_K = 256


def _f16(a: np.ndarray) -> np.ndarray:
    """[..] float -> [.., 2] bytes of its fp16."""
    return np.ascontiguousarray(a.astype(np.float16)).view(np.uint8).reshape(*a.shape, 2)


def _pack_scales_q4k(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins -> [n, 12] bytes (the inverse of gguf-py's Q4_K.get_scale_min)."""
    s = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    s[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    s[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return s


def _scale_min_blocks(w: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """[n, 8, 32] -> (d, dmin [n], sc, mn [n, 8] 6-bit codes, q [n, 8, 32] in 0..levels)."""
    lo = np.minimum(w.min(axis=2), 0.0)
    hi = w.max(axis=2)
    scale = (hi - lo) / levels
    d = (scale.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(axis=1) / 63).astype(np.float16).astype(np.float32)
    d = np.where(d > 0, d, 1.0).astype(np.float32)
    dmin = np.where(dmin > 0, dmin, 1.0).astype(np.float32)
    sc = np.clip(np.rint(scale / d[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(-lo / dmin[:, None]), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint((w + (dmin[:, None] * mn)[..., None]) / step), 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K a multiple of 256) -> Q4_K bytes [rows, K / 256 * 144]."""
    rows = w.shape[0]
    d, dmin, sc, mn, q = _scale_min_blocks(w.reshape(-1, 8, 32).astype(np.float32), 15)
    q = q.reshape(-1, 4, 2, 32)  # weights 64i + 32s + l
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([_f16(d), _f16(dmin), _pack_scales_q4k(sc, mn), qs], axis=1)
    return out.reshape(rows, -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, K] -> Q5_K bytes [rows, K / 256 * 176]."""
    rows = w.shape[0]
    d, dmin, sc, mn, q = _scale_min_blocks(w.reshape(-1, 8, 32).astype(np.float32), 31)
    low = (q & 15).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 8, 32)  # bit h of byte l: weight 32h + l
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for h in range(8):
        qh |= high[:, h] << h
    out = np.concatenate([_f16(d), _f16(dmin), _pack_scales_q4k(sc, mn), qh, qs], axis=1)
    return out.reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, K] -> Q6_K bytes [rows, K / 256 * 210]."""
    rows = w.shape[0]
    b = w.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(b).max(axis=2) / 31
    d = (np.abs(scale).max(axis=1) / 127).astype(np.float16).astype(np.float32)
    d = np.where(d > 0, d, 1.0).astype(np.float32)
    sc = np.clip(np.rint(scale / d[:, None]), -128, 127).astype(np.int8)
    step = (d[:, None] * sc.astype(np.float32))[..., None]
    step = np.where(step != 0, step, 1.0)
    q = (np.clip(np.rint(b / step), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # [n, half, 128]
    ql = ((q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)).reshape(-1, 128)
    top = (q >> 4).reshape(-1, 2, 4, 32)  # weight 128h + 32t + l
    qh = (top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), _f16(d)], axis=1)
    return out.reshape(rows, -1)


K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize(w: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [rows, K] -> GGUF blocks [rows, bytes] of type_name."""
    if type_name in K_QUANTIZERS:
        return K_QUANTIZERS[type_name](w)
    import gguf

    return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType[type_name])


def dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
    """gguf-py's dequantization of [rows, bytes] blocks -> float32 [rows, K]."""
    import gguf

    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
