// Integer weight codes as bf16 operands: shared by the AVX-512 BF16 dot kernel (cpu_linear_bf16.cpp),
// the AMX tile kernels (cpu_linear_amx.cpp) and the dense kernel's GEMM on codes (cpu_dense_bf16.cpp),
// which read the same code panels (cpu_linear.cpp's layout: int8 [panels, K, 16] or nibbles uint8
// [panels, K / 2, 16]).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu_common.h"
#include "cpu_tile.h"  // store_cols

namespace tokenmill_cpu {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The 32-entry vpermw table code_pairs<true> looks nibbles up in: bf16 0..15, repeated.
inline __m512i nibble_table() {
  alignas(64) uint16_t entries[32];
  for (int i = 0; i < 32; ++i) entries[i] = c10::BFloat16(static_cast<float>(i & 15)).x;
  return _mm512_load_si512(entries);
}

// The 32 codes of k = 2j, 2j + 1 for the panel's 16 columns as bf16 pairs: lane i holds (c(2j, i),
// c(2j + 1, i)) in its low and high 16 bits, the order vdpbf16ps pairs them with a row's (x_2j, x_2j+1),
// and the VNNI row layout of an AMX B tile.
template <bool Q4>
inline __m512i code_pairs(const int8_t* codes, int64_t j, __m512i table) {
  if (Q4) {
    // Nibble row j holds both: byte i = c(2j, i) | c(2j + 1, i) << 4. b | b << 12 puts the low nibble in
    // the low word's bits 0-3 and the high one in the high word's; vpermw reads 5 index bits, so the low
    // word's bit 4 (the high nibble's) is ignored by a table that repeats its 16 entries.
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j * 16)));
    return _mm512_permutexvar_epi16(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), table);
  }
  const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 2 * j * 16));
  const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (2 * j + 1) * 16));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(r0, r1)));  // columns 0-7
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(r0, r1)));  // columns 8-15
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // small integers: exact
}

// Each row's sum of x per block of 32 k ([rows, nb], rows >= m; the rows past m are 0), shared by every
// column's min term: m * sum(x) per block.
inline std::vector<float> block_sums(const c10::BFloat16* x, int64_t ldx, int64_t m, int64_t nb, int64_t rows) {
  std::vector<float> sums(rows * nb, 0.0f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const c10::BFloat16* xb = x + r * ldx + 32 * b;
      sums[r * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(load16(xb), load16(xb + 16)));
    }
  return sums;
}
#endif

#if defined(__AVX512F__)
// The codes of k = 2j, 2j + 1 for the panel's 16 columns as fp32 (lo, hi), straight from the code bytes
// (no bf16 pairs to unpack again, as code_pairs would give): for the kernels that rebuild the weights
// (linear_dequant_amx, cpu_gemm_bf16.cpp).
template <bool Q4>
inline void code_floats(const int8_t* codes, int64_t j, __m512& lo, __m512& hi) {
  if (Q4) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j * 16)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  } else {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 2 * j * 16))));
    hi = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (2 * j + 1) * 16))));
  }
}

#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// vpermw indices that turn [lo 0..15 | hi 0..15] into the pairs (lo i, hi i).
inline __m512i pair_interleave() {
  alignas(64) uint16_t idx[32];
  for (int i = 0; i < 16; ++i) {
    idx[2 * i] = static_cast<uint16_t>(i);
    idx[2 * i + 1] = static_cast<uint16_t>(16 + i);
  }
  return _mm512_load_si512(idx);
}

// Panel p's bf16 weights bf16(d c + m) for every k, as pairs: out[j] holds (w(2j, i), w(2j + 1, i)) for the
// 16 columns i, the dense bf16 panels' layout (cpu_dense_bf16.cpp) and an AMX B tile's rows; zeros for a
// panel past the weight's last. d c is exact, so the fma rounds once, as the fp32 weight d c + m did, and
// the RNE rounding to bf16 gives the bf16 model's weight bit for bit (the values oneDNN's path multiplies).
template <bool Q4, typename S>
void dequant_panel(__m512i* out, int64_t p, int64_t panels, int64_t nb, const int8_t* codes, int64_t kb,
                   const S* scales, const S* mins, __m512i interleave) {
  constexpr int64_t kPanel = 16, kCodeBlock = 32;
  if (p >= panels) {
    std::fill(out, out + nb * kCodeBlock / 2, _mm512_setzero_si512());
    return;
  }
  const int8_t* cp = codes + p * kb;
  const S* ps = scales + p * nb * kPanel;
  const S* pm = mins + p * nb * kPanel;
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 d = load16(ps + b * kPanel), mn = load16(pm + b * kPanel);
    for (int64_t j = b * kCodeBlock / 2; j < (b + 1) * kCodeBlock / 2; ++j) {
      __m512 lo, hi;
      code_floats<Q4>(cp, j, lo, hi);
      const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(d, hi, mn), _mm512_fmadd_ps(d, lo, mn));
      out[j] = _mm512_permutexvar_epi16(interleave, reinterpret_cast<__m512i>(both));
    }
  }
}
#endif

// run(scales pointer, mins pointer) with the scales and mins fp32 or fp16 (check_codes has checked that
// both have the same dtype).
template <typename F>
void dispatch_scales(const at::Tensor& scales, const at::Tensor& mins, F&& run) {
  if (scales.scalar_type() == at::kHalf)
    run(scales.data_ptr<c10::Half>(), mins.data_ptr<c10::Half>());
  else
    run(scales.data_ptr<float>(), mins.data_ptr<float>());
}

// run(out pointer, scales pointer, mins pointer) with out bf16 or fp32 as well: the kernels' four
// instantiations.
template <typename F>
void dispatch_codes_out(at::Tensor& out, const at::Tensor& scales, const at::Tensor& mins, F&& run) {
  dispatch_scales(scales, mins, [&](auto* sp, auto* mp) {
    if (out.scalar_type() == at::kFloat)
      run(out.data_ptr<float>(), sp, mp);
    else
      run(out.data_ptr<c10::BFloat16>(), sp, mp);
  });
}

}  // namespace tokenmill_cpu
