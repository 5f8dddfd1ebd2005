"""Which CPU kernel runs a linear, by dtype and batch rows: oneDNN's prepacked bf16, the fp32 packed
kernels, or the integer-code kernels (AVX-512 BF16 dot, AMX tiles), with the row thresholds measured on
each CPU kind and the environment switches for A/B runs. The one place these decisions are made.
"""

import functools
import os

import torch
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.kernels.cpu_probe import probe

# Batch size oneDNN lays the prepacked weights out for. Measured on the AMX CPU (bf16, 1 thread, a
# [3072, 576] weight): a 256 hint ran batches of 2 to 200 as fast as or faster than unpacked F.linear
# (1.5x at 64 rows, 3x at 200), with bit-identical results; a hint of 1 gained nothing.
PREPACK_BATCH_HINT = 256



# ...but a single row is faster unpacked: streaming all of SmolLM2's weights (cold, as in a decode
# step) took 37 ms through F.linear and 51 ms through the packed copies (same machine, interleaved runs).
PREPACK_MIN_ROWS = 2



def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN prepacking is for bf16 on CPUs; fp32 stays on F.linear (the parity reference path)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and _cpu_can_reorder_bf16()



@functools.cache
def _cpu_can_reorder_bf16() -> bool:
    """oneDNN's bf16 reorder needs AVX-512 (bw, vl, dq) or AVX-NE-CONVERT; on other CPUs (AVX2-only
    EPYCs, for one) it raises at model load, so ask the CPU once with a tiny weight."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), PREPACK_BATCH_HINT)
    except RuntimeError:
        return False
    return True



# Rows up to which the small-batch kernel (cpu_linear.cpp) runs a linear, which reads each weight once
# per step. On integer blocks larger batches go to the cache-blocked kernel (cpu_gemm.cpp), which ran
# every measured batch of SmolLM2's shapes (32-2048 rows, 2-core AVX2 EPYC) in less CPU time than torch's
# fp32 GEMM, so such a weight keeps no fp32 copy; fp32-panel weights run larger batches through torch.
CPU_PACKED_MAX_ROWS = 16



def cpu_linear_mode() -> str:
    """TOKENMILL_CPU_LINEAR: "1" (default) integer blocks where lossless, fp32 panels otherwise; "fp32"
    fp32 panels only; "0" torch's F.linear. The last two are for A/B runs and bisecting."""
    mode = os.environ.get("TOKENMILL_CPU_LINEAR", "1")
    if mode not in ("0", "1", "fp32"):
        raise ValueError(f"TOKENMILL_CPU_LINEAR must be 0, 1 or fp32, got {mode!r}")
    return mode



# Rows up to which a bf16 model's linears run on the fp32 kernel from the weights' integer codes (x
# widened to fp32, the result rounded to bf16) instead of oneDNN's prepacked bf16 weights: a row reads
# 0.75 bytes per weight (Q4 nibbles with fp32 scale and min per 32) instead of 2. Past 3 rows the
# kernel is compute-bound and oneDNN's bf16 dot products win: SmolLM2's gate_proj, 1 thread, AVX-512
# EPYC at load 3, codes vs prepacked: 1 row 87-96 vs 163-166 us, 3 rows 113-121 vs 153-175, 4 rows
# 141-147 vs 144-158, 6 rows 271-279 vs 167-181 (docs/benchmark-log.md, "bf16 from integer codes").
BF16_CODES_MAX_ROWS = 3



# ...and where the CPU has AVX-512 BF16, the codes' own bf16 dot kernel (cpu_linear_bf16.cpp), which
# multiplies by the codes as bf16 operands, up to this many rows. Decode steps of the bundled model,
# `bench roofline --dtype bfloat16 --threads 2`, this kernel up to 256 rows vs oneDNN from 1 row (AVX-512
# BF16 EPYC, two runs each): 16 rows 36.0-39.8 vs 41.1-41.9 ms, 32 rows 57.4-59.4 vs 57.5-63.0, 64 rows
# 110.8-118.4 vs 102.4-104.8, 128 rows 196-213 vs 157-169: past 32 rows oneDNN's register tiles win.
BF16_DOT_MAX_ROWS = 32



# ...and where the CPU has AMX-BF16, the codes' AMX tile kernel (cpu_linear_amx.cpp) takes batches from
# AMX_MIN_ROWS rows; fewer rows stay on the dot kernel. The 30 layers' linears of the bundled model (a
# throwaway loop, 2 threads, 2-vCPU Xeon with AMX, the same process alternating; docs/benchmark-log.md),
# dot / AMX / oneDNN in ms: 1 row 7.4 / 9.5 / 17.0, 3 rows
# 8.5 / 9.3 / 16.1, 4 rows 10.1 / 9.9 / 17.0, 16 rows 23.8 / 9.1 / 17.6, 64 rows 81 / 20.7 / 23.7,
# 128 rows 163 / 34.7 / 27.6.
AMX_MIN_ROWS = 4



# From AMX_DEQUANT_MIN_ROWS the AMX path rebuilds each panel's bf16 weights from the codes once per call
# and runs a plain tile GEMM (linear_dequant_amx) instead of scaling every block's tile
# (linear_codes_amx): the bf16 model's weights, as oneDNN multiplies them, read as codes. It takes
# batches up to AMX_CODES_MAX_ROWS; more go to oneDNN. Same loop as above on a noisier day, one process
# alternating, codes AMX / dequant AMX / oneDNN, ms: 16 rows 13.7 / 15.5 / 23.4, 24 rows 21.8 / 18.9 /
# 25.6, 32 rows 21.4 / 17.3 / 26.3, 64 rows 32.4 / 25.5 / 31.0, 96 rows 40.7 / 29.3 / 32.8, 128 rows
# 49.9 / 35.3 / 43.6; past that oneDNN and this one trade places (160 rows 36.1 vs 44.6, 256 rows
# 48.2 vs 44.6): docs/benchmark-log.md.
AMX_DEQUANT_MIN_ROWS = 24



AMX_CODES_MAX_ROWS = 128



# The LM head (Q8 codes, 49,152 x 576) crosses over earlier: its int8 codes cost more to turn into B
# tiles than nibbles. Same machine, one call, AMX vs oneDNN (+ the cast to fp32 logits), ms: 16 rows
# 2.45 vs 3.55, 32 rows 4.26 vs 4.96, 64 rows 8.35 vs 6.14; the dequant kernel, one weight in a loop:
# 64 rows 3.76 vs 2.79.
AMX_LOGITS_MAX_ROWS = 32



@functools.cache
def bf16_dot_supported() -> bool:
    """Whether the bf16 dot kernel on integer codes built (a CPU, or capped tier, with AVX-512 BF16)."""
    ops = cpu_kernels.load()
    return probe().at_least("avx512_bf16") and ops is not None and ops.linear_codes_bf16_supported()



@functools.cache
def int8x_bf16_supported() -> bool:
    """Whether `--int8-activations` applies to a bf16 model: the int8-activation kernel's AVX-512 VNNI tiles
    (kernels/csrc/cpu_codes_int8.cpp) take bf16 rows; the AVX2 ones take fp32 only."""
    ops = cpu_kernels.load()
    return ops is not None and ops.linear_int8x_bf16_supported()


@functools.cache
def amx_codes_supported() -> bool:
    """Whether the AMX tile kernel on integer codes built and may run (a CPU with AMX-BF16, and Linux
    granted this process the tile state). TOKENMILL_CODES_AMX=0 turns it off, for A/B runs."""
    if os.environ.get("TOKENMILL_CODES_AMX", "1") == "0":
        return False
    ops = cpu_kernels.load()
    return probe().at_least("amx") and ops is not None and bf16_dot_supported() and ops.linear_codes_amx_supported()



@functools.cache
def amx_dequant_min_rows() -> int:
    """AMX_DEQUANT_MIN_ROWS, or TOKENMILL_AMX_DEQUANT_ROWS for A/B runs (read once per process)."""
    return int(os.environ.get("TOKENMILL_AMX_DEQUANT_ROWS", AMX_DEQUANT_MIN_ROWS))



@functools.cache
def bf16_codes_max_rows() -> int:
    """Rows up to which a bf16 model's linears run from their integer codes (the rest: oneDNN); every
    batch where the fp32-FMA GEMM or the dense kernel on rebuilt codes takes the large ones.
    TOKENMILL_BF16_CODES_ROWS overrides it, for A/B runs (read once per process)."""
    env = os.environ.get("TOKENMILL_BF16_CODES_ROWS")
    if env is not None:
        return int(env)
    if amx_codes_supported():
        return AMX_CODES_MAX_ROWS
    if bf16_gemm_min_rows() <= BF16_DOT_MAX_ROWS:  # the GEMM on the codes takes every larger batch
        return 1 << 62
    if bf16_codes_dense_min_rows() <= BF16_DOT_MAX_ROWS + 1:  # so does the dense kernel on rebuilt codes
        return 1 << 62
    return BF16_DOT_MAX_ROWS if bf16_dot_supported() else BF16_CODES_MAX_ROWS



@functools.cache
def bf16_logits_max_rows() -> int:
    """bf16_codes_max_rows for the LM head: on the AMX kernel, at most AMX_LOGITS_MAX_ROWS."""
    if amx_codes_supported() and os.environ.get("TOKENMILL_BF16_CODES_ROWS") is None:
        return min(bf16_codes_max_rows(), AMX_LOGITS_MAX_ROWS)
    return bf16_codes_max_rows()



# A bf16 weight without integer codes (a checkpoint stored in bf16 or fp16: nearly every Hub model) runs
# on the dense bf16 kernel (cpu_dense_bf16.cpp: vdpbf16ps on weights prepacked in 16-column panels) where
# the CPU has AVX-512 BF16, at every batch size: it beat oneDNN's prepacked weights at 1, 8 and 64 rows of
# the 362M dense model's linears (docs/benchmark-log.md, "Dense bf16"), so such a weight keeps no other
# copy. On AMX CPUs oneDNN's AMX GEMM takes batches from DENSE_AMX_MIN_ROWS rows (not measured: no AMX
# machine was at hand when the kernel was written; the codes kernels' crossover to AMX was 4-16 rows).
DENSE_AMX_MIN_ROWS = 16


@functools.cache
def dense_bf16_supported() -> bool:
    """Whether bf16 weights without codes run on the dense bf16 kernel (a CPU, or capped tier, with AVX-512
    BF16 and the kernel built). TOKENMILL_DENSE_BF16=0 keeps them on oneDNN, for A/B runs."""
    if os.environ.get("TOKENMILL_DENSE_BF16", "1") == "0":
        return False
    ops = cpu_kernels.load()
    return probe().at_least("avx512_bf16") and ops is not None and ops.linear_dense_bf16_supported()


@functools.cache
def dense_bf16_max_rows() -> int:
    """Rows up to which a dense bf16 weight runs on the dense kernel; more go to oneDNN, which then keeps
    its own packed copy. Unlimited (1 << 62) below AMX. TOKENMILL_DENSE_BF16_ROWS overrides it."""
    env = os.environ.get("TOKENMILL_DENSE_BF16_ROWS")
    if env is not None:
        return int(env)
    return DENSE_AMX_MIN_ROWS - 1 if probe().at_least("amx") else 1 << 62


# The fp32-FMA GEMM (cpu_gemm_bf16.cpp: each panel group's weights widened to fp32 once per call, dense or
# from codes) takes bf16 batches from BF16_GEMM_MIN_ROWS rows on CPUs whose fp32 FMAs outrun vdpbf16ps by
# GEMM_FMA_ADVANTAGE or more (bf16_dot_fma_gflops, measured once per process). On the 2-vCPU Xeon without
# AMX: 92.7 vs 185 GFLOP/s per core, and the 362M dense model's linears (8 layers, 1 thread, CPU time)
# dot / GEMM: 16 rows 35.0 / 37.0 ms, 32 rows 65.0 / 53.1, 64 rows 123.9 / 86.3, 256 rows 481 / 310.
BF16_GEMM_MIN_ROWS = 24
GEMM_FMA_ADVANTAGE = 1.5


@functools.cache
def bf16_gemm_min_rows() -> int:
    """Rows from which bf16 linears (dense or codes) run the fp32-FMA GEMM; 1 << 62 where it does not run
    (no AVX-512 BF16, an AMX CPU, whose AMX kernels and oneDNN take large batches, or FMAs that do not
    outrun vdpbf16ps). TOKENMILL_BF16_GEMM_ROWS overrides it, for A/B runs."""
    env = os.environ.get("TOKENMILL_BF16_GEMM_ROWS")
    if env is not None:
        return int(env)
    if not dense_bf16_supported() or probe().at_least("amx"):
        return 1 << 62
    dot, fma = cpu_kernels.load().bf16_dot_fma_gflops()
    return BF16_GEMM_MIN_ROWS if fma >= GEMM_FMA_ADVANTAGE * dot else 1 << 62


@functools.cache
def bf16_codes_dense_min_rows() -> int:
    """Rows from which bf16 rows on integer codes run the dense bf16 kernel on the codes rebuilt to bf16
    panels once per block of 256 rows (linear_codes_dense), past the dot kernel's BF16_DOT_MAX_ROWS: on
    AVX-512 BF16 CPUs without AMX where the fp32-FMA GEMM does not run (vdpbf16ps outruns the FMAs). 1 << 62
    elsewhere (AMX and the GEMM take those batches; without the dense kernel, always).
    TOKENMILL_BF16_CODES_DENSE_ROWS overrides it where the kernel runs, for A/B runs (a value past 33 keeps
    it out: past BF16_DOT_MAX_ROWS the dot kernel for a GGUF loaded from its blocks, oneDNN's copy for
    codes found in fp32 weights)."""
    if not dense_bf16_supported():
        return 1 << 62
    env = os.environ.get("TOKENMILL_BF16_CODES_DENSE_ROWS")
    if env is not None:
        return int(env)
    if probe().at_least("amx") or bf16_gemm_min_rows() < 1 << 62:
        return 1 << 62
    return BF16_DOT_MAX_ROWS + 1


def bf16_codes_wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a bf16 CPU model should keep its weights' integer codes for small batches: the codes are
    found in the fp32 weights, so such a model is loaded in fp32 and cast after (ModelRunner)."""
    return can_prepack(device, dtype) and fp32_linear_ops(device, torch.float32) is not None and (
        cpu_linear_mode() == "1"
    )



def fp32_linear_ops(device: torch.device, dtype: torch.dtype) -> object | None:
    """The C++ ops when fp32 linears can run on packed weights (kernels/csrc/cpu_linear.cpp: a CPU with
    AVX2 + FMA and the kernels built); None otherwise, or with TOKENMILL_CPU_LINEAR=0."""
    if device.type != "cpu" or dtype != torch.float32 or cpu_linear_mode() == "0":
        return None
    ops = cpu_kernels.load()
    if ops is None or not ops.packed_linear_supported():
        return None
    return ops
