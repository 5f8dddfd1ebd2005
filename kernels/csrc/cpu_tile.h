// What the AVX-512 row-tile kernels share around their inner loops: the dense bf16 tiles
// (cpu_dense_bf16.cpp), the fp32-FMA GEMM (cpu_gemm_bf16.cpp), the bf16 dot tiles on integer codes
// (cpu_linear_bf16.cpp) and on GGUF's grouped codes (cpu_grouped.cpp). Each held its own copy of the
// bias-add-and-store loop and of the switch from a row count to its tile height; one copy here keeps them
// the same (the same instructions in the same order, so the same results bit for bit).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "cpu_common.h"

namespace tokenmill_cpu {

// Calls fn(std::integral_constant<int, R>{}) with R = rows for rows 1 .. Max - 1 and R = Max otherwise
// (the row count of a tile, from a remainder the caller has already capped at Max). A tile's row count
// must be a compile-time constant for its sums to live in registers, so each height is its own
// instantiation; this picks it, as the switch with a default of Max each kernel used to write out.
template <int Max, int R = 1, typename F>
inline void with_tile_rows(int64_t rows, F&& fn) {
  if constexpr (R < Max) {
    if (rows == R) {
      fn(std::integral_constant<int, R>{});
      return;
    }
    with_tile_rows<Max, R + 1>(rows, std::forward<F>(fn));
  } else {
    fn(std::integral_constant<int, Max>{});
  }
}

#if defined(__AVX512F__)
// 16 outputs to o, or their first `cols` (the weight's last panel may be ragged).
template <typename TOut>
inline void store_cols(TOut* o, __m512 y, int64_t cols) {
  if (cols == 16) {
    store16(o, y);
  } else {
    alignas(64) TOut tmp[16];
    store16(tmp, y);
    std::copy(tmp, tmp + cols, o);
  }
}

// A tile's sums for 16 columns as one vector: kept in a register, or in an L1 array (the dot kernels,
// whose block sums take the registers).
inline __m512 tile_sums(__m512 v) { return v; }
inline __m512 tile_sums(const float (&v)[16]) { return _mm512_load_ps(v); }

// out[r, 16 q + c] = sums[r][q][c] + bias[16 q + c] (no bias: + 0) for R rows and P panels of 16 columns,
// ldo apart; cols < 16 only in the last panel (the weight's ragged end), where neither the bias nor out is
// read or written past it. Always inlined, so a caller's register sums stay in registers.
template <int R, int P, typename Sums, typename TOut>
__attribute__((always_inline)) inline void store_tile(const Sums (&sums)[R][P], TOut* out, int64_t ldo, int64_t cols,
                                                      const float* bias) {
#pragma GCC unroll 4
  for (int q = 0; q < P; ++q) {
    const int64_t c = q == P - 1 ? cols : 16;
    __m512 bv = _mm512_setzero_ps();
    if (bias != nullptr) bv = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << c) - 1), bias + q * 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) store_cols(out + r * ldo + q * 16, _mm512_add_ps(tile_sums(sums[r][q]), bv), c);
  }
}
#endif

}  // namespace tokenmill_cpu
