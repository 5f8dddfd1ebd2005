// Scalar helpers shared by the C++ CPU kernels. Plain arithmetic (no library calls), so loops around
// them vectorize.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

namespace tokenmill_cpu {

// Calls fn(T{}) with T the C++ type of t's dtype: float, c10::BFloat16 or c10::Half.
template <typename F>
inline void dispatch(const at::Tensor& t, const char* name, F&& fn) {
  switch (t.scalar_type()) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    default: TORCH_CHECK(false, name, ": dtype must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  // bf16 is the top half of an fp32.
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// The value a torch op on T tensors stores: computed in fp32, rounded to T (nearest even).
template <typename T>
inline float round_to(float f) {
  return to_float(static_cast<T>(f));
}

// exp(x), Cephes' single-precision polynomial (about 1 ulp). Inputs are clamped to [-87, 89]: below,
// the result stays near 1e-38 instead of reaching 0; above 88.72 it overflows to inf as expf does.
// 2^n is applied as 2^(n-1) * 2 so that n = 128 (results just under FLT_MAX) stays finite.
inline float exp_poly(float x) {
  x = std::min(std::max(x, -87.0f), 89.0f);
  float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  x = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  float z = x * x;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  int32_t bits = (static_cast<int32_t>(fx) + 126) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale * 2.0f;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  // bf16 is the top half of an fp32: widen to 32 bits and shift.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// v's fp32 bits rounded to nearest even at bit 16, as c10::BFloat16(float) rounds (NaN inputs do not
// occur in these layers): the bf16 value is the top half.
inline __m512i bf16_rne_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rne_bits(v), 16)));
}
inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// What storing to T and loading back gives: the rounding a torch op on T tensors applies. In registers:
// through memory (store16, load16) it cost a store-to-load round trip per 16 values.
inline __m512 round16(const float*, __m512 v) { return v; }
inline __m512 round16(const c10::BFloat16*, __m512 v) {
  // store16's rounding with the low 16 bits cleared: the bf16 value as an fp32.
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_rne_bits(v), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline __m512 round16(const c10::Half*, __m512 v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// exp_poly on 16 lanes.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(89.0f));
  const __m512 fx = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.0f));
  const __m512i n = _mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(126));
  return _mm512_mul_ps(_mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(n, 23))), _mm512_set1_ps(2.0f));
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 machines (no AVX-512): the same helpers on 8 lanes.
#define TOKENMILL_AVX2 1
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp_poly on 8 lanes.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(89.0f));
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
  const __m256i n = _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(126));
  return _mm256_mul_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23))), _mm256_set1_ps(2.0f));
}

#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The linear kernels (cpu_linear.cpp, cpu_gemm.cpp) are written for 8 lanes and built on every CPU with
// AVX2 + FMA, AVX-512 ones included: without them an AVX-512 machine ran its fp32 linears through torch
// (TOKENMILL_AVX2 above names only the AVX2-only machines, where the 8-lane attention and layer paths run).
#define TOKENMILL_LINEAR_AVX2 1

// Code rows of a panel: int8 [K, 16], or nibbles uint8 [K / 2, 16] with k = 2j in the low and k = 2j + 1
// in the high 4 bits of row j (weights whose codes all fit 0..15, GGUF Q4_*: the same values from half the
// bytes). code_row gives the 16 codes of row i as bytes; codes8 widens 8 of them to fp32.
template <bool Q4>
inline __m128i code_row(const int8_t* codes, int64_t i) {
  if (!Q4) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i * 16));
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i / 2 * 16));
  return _mm_and_si128((i & 1) ? _mm_srli_epi16(c, 4) : c, _mm_set1_epi8(0x0f));
}

template <bool Q4>
inline __m256 codes8(__m128i c) {
  return _mm256_cvtepi32_ps(Q4 ? _mm256_cvtepu8_epi32(c) : _mm256_cvtepi8_epi32(c));
}

// Code panel rows [k, 16] -> fp32, w = fma(code, scale, min) per 32 k (k a multiple of 32, `codes` at an
// even row): the one rounding of scale * code + min that the stored fp32 weight holds (cpu_linear.cpp's
// tiles do the same in registers). Used by cpu_linear.cpp and cpu_gemm.cpp to rebuild a panel, or a
// K-slice of one.
template <bool Q4>
inline void rebuild_codes16(const int8_t* codes, const float* scales, const float* mins, int64_t k, float* out) {
  for (int64_t b = 0; b < k / 32; ++b) {
    const __m256 d0 = _mm256_loadu_ps(scales + b * 16), d1 = _mm256_loadu_ps(scales + b * 16 + 8);
    const __m256 m0 = _mm256_loadu_ps(mins + b * 16), m1 = _mm256_loadu_ps(mins + b * 16 + 8);
    for (int64_t i = b * 32; i < (b + 1) * 32; ++i) {
      const __m128i c = code_row<Q4>(codes, i);
      _mm256_storeu_ps(out + i * 16, _mm256_fmadd_ps(codes8<Q4>(c), d0, m0));
      _mm256_storeu_ps(out + i * 16 + 8, _mm256_fmadd_ps(codes8<Q4>(_mm_srli_si128(c, 8)), d1, m1));
    }
  }
}
#endif

// Argument checks of the linear ops on packed weights (cpu_linear.cpp, cpu_gemm.cpp), for one wording.
inline bool linear_kernels_built() {
#if defined(TOKENMILL_LINEAR_AVX2)
  return true;
#else
  return false;
#endif
}

// Integer codes int8 [panels, K, 16] (K = k unless k < 0), or where nibbles_ok nibble codes uint8
// [panels, K / 2, 16], with scales and mins float32 [panels, K / 32, 16] (or both float16 where half_ok).
inline void check_codes(const char* op, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                        int64_t k, bool nibbles_ok = false, bool half_ok = false) {
  const bool q4 = nibbles_ok && codes.scalar_type() == at::kByte;
  const int64_t per_row = q4 ? 2 : 1;  // codes per byte
  TORCH_CHECK(codes.device().is_cpu() && (q4 || codes.scalar_type() == at::kChar) && codes.dim() == 3 &&
                  codes.size(2) == 16 && codes.is_contiguous() && (k < 0 || codes.size(1) * per_row == k),
              op, ": codes are int8 [panels, K", k < 0 ? "" : "=", k < 0 ? "" : std::to_string(k), ", 16]",
              nibbles_ok ? " or uint8 nibbles [panels, K / 2, 16]" : "", ", got ", codes.scalar_type(), " ",
              codes.sizes());
  const int64_t kk = codes.size(1) * per_row, panels = codes.size(0);
  TORCH_CHECK(kk % 32 == 0, op, ": K=", kk, " is not a multiple of ", 32);
  const bool half = half_ok && scales.scalar_type() == at::kHalf;
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == (half ? at::kHalf : at::kFloat) && t->is_contiguous() &&
                    t->dim() == 3 && t->size(0) == panels && t->size(1) == kk / 32 && t->size(2) == 16,
                op, ": scales and mins are ", half_ok ? "both float32 or both float16" : "float32", " [", panels, ", ",
                kk / 32, ", 16], got ", t->sizes(), " ", t->scalar_type());
}

// x and out as the kernels read and write them (float32, or both bfloat16 where bf16_ok; a bfloat16 x may
// also write float32 out where fp32_out_ok), out's width against the weight's panels of 16, and the bias;
// returns the bias pointer (nullptr without one).
inline const float* check_linear_args(const char* op, const at::Tensor& out, const at::Tensor& x, int64_t panels,
                                      const char* weight_name, const c10::optional<at::Tensor>& bias,
                                      bool bf16_ok = false, bool fp32_out_ok = false) {
  TORCH_CHECK(linear_kernels_built(), op, ": this build has no AVX2 + FMA path");
  const bool bf16 = bf16_ok && x.scalar_type() == at::kBFloat16;
  const char* dtype = bf16 ? (fp32_out_ok ? "bfloat16 or float32" : "bfloat16") : "float32";
  TORCH_CHECK(x.device().is_cpu() && (bf16 || x.scalar_type() == at::kFloat) && x.dim() == 2 && x.stride(1) == 1, op,
              ": x must be 2-D float32", bf16_ok ? " or bfloat16" : "", " with contiguous rows");
  const bool out_dtype_ok =
      out.scalar_type() == x.scalar_type() || (bf16 && fp32_out_ok && out.scalar_type() == at::kFloat);
  TORCH_CHECK(out.device().is_cpu() && out_dtype_ok && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0),
              op, ": out must be 2-D ", dtype, " [rows of x, N] with contiguous rows");
  const int64_t n = out.size(1);
  TORCH_CHECK(n <= panels * 16 && n > (panels - 1) * 16, op, ": out has ", n, " columns, ", weight_name, " ", panels,
              " panels of 16");
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == n, op,
              ": bias must be contiguous float32 [", n, "]");
  return bias->data_ptr<float>();
}

}  // namespace tokenmill_cpu
