"""The building blocks models are made of, one file per kind (linear, layernorm, rotary embedding,
activation, attention), the CPU GEMM policy that picks a kernel per batch size, and the integer codes found
in dequantized weights. Runs in every rank. May import tokenmill.kernels, distributed/ and the top-level
leaves; never models/ or anything above.
"""
