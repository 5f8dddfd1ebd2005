// The int8-activation linear's panel loop (cpu_codes_int8.cpp), shared by the two weight layouts whose codes
// sit in the same panels (int8 [panels, K, 16] or nibbles uint8 [panels, K / 2, 16]) but whose per-block
// scales differ: cpu_linear.cpp's fp32 scale and min per 32, and cpu_grouped.cpp's K-quant / AWQ scales.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace tokenmill_cpu {

// Panel p's scale and min per 32 k and column (w = scale * q + min), [K / 32, 16] fp32 each: pointers into
// the weight's own arrays, or into `scratch` (room for both) where the layout has to compute them.
using PanelScales = void (*)(const void* ctx, int64_t p, float* scratch, const float** scale, const float** min);

// out [M, N] (rows contiguous) = x [M, K] @ W^T (+ bias [N]) with each row of x rounded to int8 per 32 k; W's
// codes at `codes` (nibbles when q4), `panels` panels of 16 columns. x and out fp32, or with the VNNI tiles
// (int8x_vnni_built) bf16 x and bf16 or fp32 out. The caller checks shapes and dtypes.
void linear_int8x_panels(at::Tensor& out, const at::Tensor& x, const int8_t* codes, bool q4, int64_t panels,
                         const float* bias, PanelScales panel_scales, const void* ctx);

// Whether this build has the AVX-512 VNNI tiles, which also take bf16 rows.
bool int8x_vnni_built();

}  // namespace tokenmill_cpu
