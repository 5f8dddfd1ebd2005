// 8-bit KV caches (--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2): the slot layout, the quantizer the store
// op runs and the loads the attention kernel dequantizes with.
//
// Layout: the cache tensor is [num_blocks, block_size, num_kv_heads, head_dim + 4] of int8 / float8_e4m3fn /
// float8_e5m2; each (token, KV head) row holds head_dim codes and then its fp32 scale (the row's absmax /
// the code's largest value, kKvScaleBytes bytes). A value is code * scale. Per token and head, so one outlier
// token or head does not flatten the others' resolution (a per-tensor scale, vLLM's fp8 default, is what the
// parity measurements in docs/engine.md compare against); beside its codes, so one slot read brings both.
// kernels/reference.py (quantize_kv, dequantize_kv) is the torch twin: same arithmetic, same bits.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_common.h"

namespace tokenmill_cpu {

constexpr int64_t kKvScaleBytes = 4;  // engine/kv_memory.py KV_SCALE_BYTES

// Per code type: whether it is an 8-bit code, its largest magnitude (the row's absmax maps to it), and what
// the kernel's raw load gives for a code of value 1 (the fp16 trick for e4m3 below yields value / 256).
template <typename C>
struct KvCode {
  static constexpr bool quantized = false;
  static constexpr float qmax = 1.0f;
  static constexpr float raw_unit = 1.0f;
};
template <>
struct KvCode<int8_t> {
  static constexpr bool quantized = true;
  static constexpr float qmax = 127.0f;
  static constexpr float raw_unit = 1.0f;
};
template <>
struct KvCode<c10::Float8_e4m3fn> {
  static constexpr bool quantized = true;
  static constexpr float qmax = 448.0f;
  static constexpr float raw_unit = 1.0f / 256.0f;
};
template <>
struct KvCode<c10::Float8_e5m2> {
  static constexpr bool quantized = true;
  static constexpr float qmax = 57344.0f;
  static constexpr float raw_unit = 1.0f;
};

// Elements per (token, head) row of the cache: head_dim codes, then the scale's bytes for 8-bit codes.
template <typename C>
constexpr int64_t kv_row(int64_t head_dim) {
  return head_dim + (KvCode<C>::quantized ? kKvScaleBytes : 0);
}

// The row's scale, multiplied by what turns a raw load into the code's value.
template <typename C>
inline float kv_scale(const C* row, int64_t head_dim) {
  float s;
  std::memcpy(&s, reinterpret_cast<const char*>(row + head_dim), sizeof(s));
  return s / KvCode<C>::raw_unit;
}

// Raw scalar loads: a code's value times raw_unit (exact in fp32). e4m3 -> fp16 by moving its bits into
// fp16's fields (exponent bias 15 instead of 7: the value / 256; e4m3 subnormals land on fp16
// subnormals, which the conversion handles without a microcode assist); e5m2 is fp16's top byte.
inline float raw_code(int8_t c) { return static_cast<float>(c); }
inline uint16_t e4m3_half_bits(uint8_t b) {
  return static_cast<uint16_t>((static_cast<int16_t>(static_cast<int8_t>(b)) << 7) & 0xBF80);
}
inline float raw_code(c10::Float8_e4m3fn c) { return c10::detail::fp16_ieee_to_fp32_value(e4m3_half_bits(c.x)); }
inline float raw_code(c10::Float8_e5m2 c) {
  return c10::detail::fp16_ieee_to_fp32_value(static_cast<uint16_t>(static_cast<uint16_t>(c.x) << 8));
}
template <typename T>
inline float raw_code(T x) {
  return to_float(x);
}

// Codes of one row of n fp32 values; returns the scale stored beside them. Same operations, in the same
// order, as kernels/reference.py's quantize_kv: absmax, scale = absmax / qmax, code = x / scale rounded
// (int8: to nearest even, clamped; fp8: c10's conversion, nearest even, saturating). An all-zero row keeps
// scale 0 and zero codes.
inline void quantize_code(float q, int8_t* out) {
  *out = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(q))));
}
inline void quantize_code(float q, c10::Float8_e4m3fn* out) { *out = c10::Float8_e4m3fn(q); }
inline void quantize_code(float q, c10::Float8_e5m2* out) { *out = c10::Float8_e5m2(q); }

template <typename C>
inline float quantize_row(const float* x, int64_t n, C* codes) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::fabs(x[i]));
  const float scale = absmax / KvCode<C>::qmax;
  const float divisor = scale > 0.0f ? scale : 1.0f;
  for (int64_t i = 0; i < n; ++i) quantize_code(x[i] / divisor, codes + i);
  return scale;
}

#if defined(__AVX512F__)
// 16 raw codes as fp32 (the value times raw_unit).
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
  return _mm512_cvtph_ps(h);
}
inline __m512 load16(const c10::Float8_e5m2* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
}
#endif

#if defined(TOKENMILL_AVX2)
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<short>(0xBF80))));
}
inline __m256 load8(const c10::Float8_e5m2* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
}
#endif

// Calls fn(T{}, C{}) with T the C++ type of the query's dtype and C the cache's: the same type for a 16/32-bit
// cache, int8_t, c10::Float8_e4m3fn or c10::Float8_e5m2 for an 8-bit one.
template <typename F>
inline void dispatch_kv(const at::Tensor& q, const at::Tensor& cache, const char* name, F&& fn) {
  dispatch(q, name, [&](auto tag) {
    using T = decltype(tag);
    switch (cache.scalar_type()) {
      case at::kChar: fn(T{}, int8_t{}); break;
      case at::kFloat8_e4m3fn: fn(T{}, c10::Float8_e4m3fn{}); break;
      case at::kFloat8_e5m2: fn(T{}, c10::Float8_e5m2{}); break;
      default:
        TORCH_CHECK(cache.scalar_type() == q.scalar_type(), name, ": the cache's dtype must be the model's (",
                    q.scalar_type(), ") or int8 / float8_e4m3fn / float8_e5m2, got ", cache.scalar_type());
        fn(T{}, T{});
    }
  });
}

}  // namespace tokenmill_cpu
