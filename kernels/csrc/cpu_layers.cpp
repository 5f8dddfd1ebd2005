// Fused elementwise layers for CPUs: RMSNorm (with the residual add), neox rotary embedding in place,
// SiLU-and-mul. Each replaces 3-8 torch ops per call; at batch 1 a decode step was mostly such small
// ops (dispatch and allocation, not arithmetic), see docs/benchmark-log.md.
//
// Rounding follows transformers' Llama code op by op: the residual sum, the normalised value, the
// products of rotary and silu(gate) are each rounded to the model dtype where transformers rounds
// them, and statistics stay in fp32. Built with -ffp-contract=off so fp32 products are not fused
// into FMAs that transformers does not do.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>

#include "cpu_common.h"
#include "cpu_ops.h"

namespace {

using tokenmill_cpu::dispatch;
using tokenmill_cpu::exp_poly;
using tokenmill_cpu::round_to;
using tokenmill_cpu::to_float;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

void check_norm_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [hidden] of x's dtype");
}

// The sum of squares in 16 lanes (lane j: x[j], x[j + 16], ... in order), then the tail, then the lanes
// in order: the same fp32 sum with or without AVX-512 (the scalar loops did not vectorize for bf16: a
// 64-row norm took 44 us on one thread of the AMX Xeon).
template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  alignas(64) float acc[16] = {0};
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 accv = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = tokenmill_cpu::load16(x + i);
    accv = _mm512_add_ps(accv, _mm512_mul_ps(v, v));
  }
  _mm512_store_ps(acc, accv);
#else
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) {
      const float v = to_float(x[i + j]);
      acc[j] += v * v;
    }
#endif
  float ss = 0;
  for (; i < n; ++i) ss += to_float(x[i]) * to_float(x[i]);
  for (int j = 0; j < 16; ++j) ss += acc[j];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  i = 0;
#if defined(__AVX512F__)
  const __m512 iv = _mm512_set1_ps(inv);
  for (; i + 16 <= n; i += 16) {
    const __m512 normed = tokenmill_cpu::round16(x, _mm512_mul_ps(tokenmill_cpu::load16(x + i), iv));
    tokenmill_cpu::store16(out + i, _mm512_mul_ps(normed, tokenmill_cpu::load16(w + i)));
  }
#endif
  for (; i < n; ++i) out[i] = static_cast<T>(round_to<T>(to_float(x[i]) * inv) * to_float(w[i]));
}

// out = weight * norm(x)
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(out, x, weight);
  const int64_t n = x.size(1);
  dispatch(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        norm_row<T>(xp + r * x.stride(0), wp, op + r * out.stride(0), n, static_cast<float>(eps));
    });
  });
}

// x += residual (rounded to the dtype: the new residual stream), then out = weight * norm(x).
void add_rms_norm(at::Tensor out, at::Tensor x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_norm_args(out, x, weight);
  check_rows(residual, "residual");
  const int64_t n = x.size(1);
  dispatch(x, "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    T* xp = x.data_ptr<T>();
    const T* rp = residual.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        T* xr = xp + r * x.stride(0);
        const T* rr = rp + r * residual.stride(0);
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16)
          tokenmill_cpu::store16(xr + i, _mm512_add_ps(tokenmill_cpu::load16(xr + i), tokenmill_cpu::load16(rr + i)));
#endif
        for (; i < n; ++i) xr[i] = static_cast<T>(to_float(xr[i]) + to_float(rr[i]));
        norm_row<T>(xr, wp, op + r * out.stride(0), n, static_cast<float>(eps));
      }
    });
  });
}

// Neox (rotate-half) rotary embedding in place on x [tokens, heads, head_dim] (a view of the fused qkv
// rows is fine: any token and head strides, contiguous last dim). cos/sin: [max_position, head_dim / 2].
void rotary_neox(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, head_dim] on CPU");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "positions must be int64 [tokens]");
  const int64_t half = x.size(2) / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == half && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin must be contiguous [max_position, head_dim / 2] of x's dtype");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the rotary table [0, ", max_pos, ")");
  dispatch(x, "rotary_neox", [&](auto tag) {
    using T = decltype(tag);
    T* xp = x.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
#if defined(__AVX512F__)
    const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));  // -x2 by flipping its sign bit
#endif
    at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const T* c = cp + pos[t] * half;
        const T* s = sp + pos[t] * half;
        for (int64_t h = 0; h < x.size(1); ++h) {
          T* v = xp + t * x.stride(0) + h * x.stride(1);
          int64_t i = 0;
#if defined(__AVX512F__)
          // The scalar loop below, 16 lanes at a time (it did not vectorize for bf16: 2.9 ns a value).
          for (; i + 16 <= half; i += 16) {
            const __m512 x1 = tokenmill_cpu::load16(v + i), x2 = tokenmill_cpu::load16(v + i + half);
            const __m512 ci = tokenmill_cpu::load16(c + i), si = tokenmill_cpu::load16(s + i);
            const __m512 neg_x2 = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x2), sign));
            const __m512 lo = _mm512_add_ps(tokenmill_cpu::round16(v, _mm512_mul_ps(x1, ci)),
                                            tokenmill_cpu::round16(v, _mm512_mul_ps(neg_x2, si)));
            const __m512 hi = _mm512_add_ps(tokenmill_cpu::round16(v, _mm512_mul_ps(x2, ci)),
                                            tokenmill_cpu::round16(v, _mm512_mul_ps(x1, si)));
            tokenmill_cpu::store16(v + i, lo);
            tokenmill_cpu::store16(v + i + half, hi);
          }
#endif
          for (; i < half; ++i) {
            const float x1 = to_float(v[i]);
            const float x2 = to_float(v[i + half]);
            const float ci = to_float(c[i]);
            const float si = to_float(s[i]);
            // transformers: x * cos + rotate_half(x) * sin, every product and sum rounded to T.
            v[i] = static_cast<T>(round_to<T>(x1 * ci) + round_to<T>(-x2 * si));
            v[i + half] = static_cast<T>(round_to<T>(x2 * ci) + round_to<T>(x1 * si));
          }
        }
      }
    });
  });
}

// x = [gate | up] rows -> out = silu(gate) * up, silu rounded to the dtype first (as F.silu then mul).
void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t d = x.size(1) / 2;
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == d, "out must be [rows, x.size(1) / 2]");
  dispatch(x, "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const T* g = xp + r * x.stride(0);
        const T* u = g + d;
        T* o = op + r * out.stride(0);
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= d; i += 16) {
          const __m512 gv = tokenmill_cpu::load16(g + i);
          const __m512 e = tokenmill_cpu::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
          const __m512 silu = tokenmill_cpu::round16(g, _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
          tokenmill_cpu::store16(o + i, _mm512_mul_ps(silu, tokenmill_cpu::load16(u + i)));
        }
#elif defined(TOKENMILL_AVX2)
        // fp32 only (the dtype AVX2 machines run; no rounding step): the scalar loop below did not
        // vectorize and took 4x torch's F.silu * up at 64 rows.
        if constexpr (std::is_same_v<T, float>) {
          for (; i + 8 <= d; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = tokenmill_cpu::exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
          }
        }
#endif
        for (; i < d; ++i) {
          const float gv = to_float(g[i]);
          const float silu = round_to<T>(gv / (1.0f + exp_poly(-gv)));
          o[i] = static_cast<T>(silu * to_float(u[i]));
        }
      }
    });
  });
}

}  // namespace

// The ops as plain calls for cpu_decoder.cpp (cpu_ops.h).
namespace tokenmill_cpu {
void add_rms_norm(at::Tensor out, at::Tensor x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  ::add_rms_norm(out, x, residual, weight, eps);
}
void rotary_neox(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  ::rotary_neox(x, positions, cos, sin);
}
void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  ::silu_and_mul(out, x);
}
}  // namespace tokenmill_cpu

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) x, Tensor residual, Tensor weight, float eps) -> ()");
  m.def("rotary_neox(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.impl("rotary_neox", c10::DispatchKey::CPU, &rotary_neox);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
}
