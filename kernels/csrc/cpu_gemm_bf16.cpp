// GEMMs for a bf16 model's larger batches (decode at high concurrency, prompt chunks) on AVX-512 CPUs: the
// weights of each group of 3 panels are rebuilt to fp32 once per call (K-slices of kKc) and an 8 x 48
// register tile of fp32 FMAs runs over every row, x widened to fp32 once per row block.
//
// Why: on Intel cores with AVX-512 BF16 and no AMX (this 2-vCPU Xeon), vdpbf16ps retires once per 2
// cycles and an fp32 FMA twice per cycle: 32 against 64 FLOP per cycle (one core, 24 independent
// accumulators: 83.6 against 166.9 GFLOP/s). oneDNN's bf16 GEMM and the dot kernels (cpu_dense_bf16.cpp,
// cpu_linear_bf16.cpp) run on the former, so once a batch is bound by arithmetic rather than by reading
// the weights, fp32 FMAs on widened weights do the same work in about half the cycles. Widening costs a
// shift (bf16) or a convert and FMA (codes) per 16 weights, once per call, against 8 FMAs per row tile:
// small from a few dozen rows. bf16_dot_fma_gflops measures both rates, so engine/layers/cpu_gemm_policy.py
// takes this path only on CPUs where it wins (where vdpbf16ps is as fast as two FMAs it would not).
//
// Weights: dense bf16 panels (cpu_dense_bf16.cpp's pack_bf16_weight layout), or integer codes (int8 or
// nibbles, fp32 or fp16 scales and mins: cpu_linear.cpp's layout) rebuilt as fma(code, scale, min), the
// fp32 weight a GGUF conversion holds (what the dot kernel and the fp32 kernels multiply by).
//
// Numerics: each output is one fp32 sum over k in order 0..K-1, one fused multiply-add per term (exact
// products of bf16 x and bf16 weights; fp32 weights for codes), stored between K-slices in fp32 (exact), the
// bias added last, rounded once to bf16 (or kept: fp32 logits). A row's result does not depend on the rows
// beside it or on the thread count.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "cpu_codes_bf16.h"
#include "cpu_common.h"
#include "cpu_ops.h"
#include "cpu_tile.h"

namespace {

constexpr int64_t kPanel = 16;     // output columns per panel
constexpr int64_t kGroup = 3;      // panels per register tile: 3 weight vectors, 8 rows -> 24 accumulators
constexpr int64_t kTileRows = 8;
constexpr int64_t kCodeBlock = 32;  // k per scale/min pair
// K per slice (a multiple of 32, so a slice never splits a scale/min pair): the group's rebuilt slice is
// 3 x 1024 x 16 fp32 = 192 KB, in L2 with the row block's fp32 x slice (128 x 1024 x 4 = 512 KB).
constexpr int64_t kKc = 1024;
constexpr int64_t kRowBlock = 128;

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TOKENMILL_GEMM_BF16 1

struct Span {
  const char* p;
  int64_t bytes;
};

// Part `part` of `parts` of the next work item's weights into L2: the hardware prefetchers stop at page
// boundaries and a thread's next panel group lies elsewhere, so without this each group's first row tile
// waited on memory (64 rows of the 362M model's linears: 115 GFLOP/s, against 138 at 256 rows).
template <typename Src>
inline void prefetch_part(const Src& src, int64_t p, int64_t np, int64_t k0, int64_t kc, int64_t part, int64_t parts) {
  Span spans[3];
  for (int64_t q = 0; q < np; ++q) {
    const int n = src.spans(p + q, k0, kc, spans);
    for (int i = 0; i < n; ++i) {
      const int64_t lines = (spans[i].bytes + 63) / 64;
      for (int64_t l = lines * part / parts; l < lines * (part + 1) / parts; ++l)
        _mm_prefetch(spans[i].p + l * 64, _MM_HINT_T1);
    }
  }
}

// Dense bf16 panels [panels, K / 2, 32]: row j holds (w[2j, i], w[2j + 1, i]) for the 16 columns i.
struct DenseSource {
  const c10::BFloat16* w;
  int64_t pstride;  // elements per panel (K x 16)
  // The bytes rebuild(p, k0, kc) reads: one span.
  int spans(int64_t p, int64_t k0, int64_t kc, Span* out) const {
    out[0] = {reinterpret_cast<const char*>(w + p * pstride + k0 * kPanel), kc * kPanel * 2};
    return 1;
  }
  // Panel p's k in [k0, k0 + kc) as fp32 [kc, 16] (kc even).
  void rebuild(int64_t p, int64_t k0, int64_t kc, float* dst) const {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    const c10::BFloat16* src = w + p * pstride + k0 * kPanel;
    for (int64_t j = 0; j < kc / 2; ++j) {
      const __m512i v = _mm512_loadu_si512(src + j * 2 * kPanel);
      _mm512_storeu_ps(dst + 2 * j * kPanel, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
      _mm512_storeu_ps(dst + (2 * j + 1) * kPanel, _mm512_castsi512_ps(_mm512_and_si512(v, high)));
    }
  }
};

// Integer codes with a scale and a min per 32 k: w = fma(code, scale, min).
template <bool Q4, typename S>
struct CodesSource {
  const int8_t* codes;
  int64_t kb;  // code bytes per panel
  const S* scales;
  const S* mins;
  int64_t nb;  // blocks of 32 per row (K / 32)
  int spans(int64_t p, int64_t k0, int64_t kc, Span* out) const {
    const int64_t per_k = Q4 ? kPanel / 2 : kPanel;  // code bytes per k
    out[0] = {reinterpret_cast<const char*>(codes + p * kb + k0 * per_k), kc * per_k};
    const int64_t s0 = (p * nb + k0 / kCodeBlock) * kPanel, sn = kc / kCodeBlock * kPanel * sizeof(S);
    out[1] = {reinterpret_cast<const char*>(scales + s0), sn};
    out[2] = {reinterpret_cast<const char*>(mins + s0), sn};
    return 3;
  }
  void rebuild(int64_t p, int64_t k0, int64_t kc, float* dst) const {
    const int8_t* cp = codes + p * kb;
    for (int64_t b = k0 / kCodeBlock; b < (k0 + kc) / kCodeBlock; ++b) {
      const __m512 d = tokenmill_cpu::load16(scales + (p * nb + b) * kPanel);
      const __m512 mn = tokenmill_cpu::load16(mins + (p * nb + b) * kPanel);
      for (int64_t j = b * kCodeBlock / 2; j < (b + 1) * kCodeBlock / 2; ++j) {
        __m512 lo, hi;
        tokenmill_cpu::code_floats<Q4>(cp, j, lo, hi);
        _mm512_storeu_ps(dst + (2 * j - k0) * kPanel, _mm512_fmadd_ps(lo, d, mn));
        _mm512_storeu_ps(dst + (2 * j + 1 - k0) * kPanel, _mm512_fmadd_ps(hi, d, mn));
      }
    }
  }
};

// R rows x P panels over one K-slice: b the rebuilt slice [P][kc][16], x fp32 rows (ldx apart, at the
// slice's first k). Starts from zero (first) or the running sums in acc (ld P x 16); the last slice adds the
// bias and stores to out, earlier ones store the running sums back to acc.
template <int R, int P, typename TOut>
inline void gemm_tile(const float* x, int64_t ldx, const float* b, int64_t kc, float* acc_io, bool first, bool last,
                      TOut* out, int64_t ldo, int64_t cols, const float* bias) {
  constexpr int64_t lda = P * kPanel;
  __m512 acc[R][P];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int q = 0; q < P; ++q)
      acc[r][q] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_io + r * lda + q * kPanel);
  for (int64_t k = 0; k < kc; ++k) {
    __m512 w[P];
#pragma GCC unroll 3
    for (int q = 0; q < P; ++q) w[q] = _mm512_loadu_ps(b + (q * kc + k) * kPanel);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 3
      for (int q = 0; q < P; ++q) acc[r][q] = _mm512_fmadd_ps(w[q], xb, acc[r][q]);
    }
  }
  if (!last) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
      for (int q = 0; q < P; ++q) _mm512_storeu_ps(acc_io + r * lda + q * kPanel, acc[r][q]);
    return;
  }
  tokenmill_cpu::store_tile(acc, out, ldo, cols, bias);
}

template <int P, typename TOut>
void rows_tile(int64_t rows, const float* x, int64_t ldx, const float* b, int64_t kc, float* acc_io, bool first,
               bool last, TOut* out, int64_t ldo, int64_t cols, const float* bias) {
  tokenmill_cpu::with_tile_rows<kTileRows>(rows, [&](auto r) {
    gemm_tile<decltype(r)::value, P, TOut>(x, ldx, b, kc, acc_io, first, last, out, ldo, cols, bias);
  });
}

template <typename TOut>
using TileFn = void (*)(int64_t, const float*, int64_t, const float*, int64_t, float*, bool, bool, TOut*, int64_t,
                        int64_t, const float*);

template <typename TOut>
TileFn<TOut> tile_for(int64_t panels) {
  return panels == 1 ? rows_tile<1, TOut> : panels == 2 ? rows_tile<2, TOut> : rows_tile<3, TOut>;
}

// out [m, n] = x [m, k] (bf16, ldx apart) @ W^T (+ bias) with W's panels rebuilt by src.
template <typename Src, typename TOut>
void gemm(const Src& src, const c10::BFloat16* xp, int64_t ldx, int64_t m, int64_t k, int64_t panels, int64_t n,
          const float* bias, TOut* out, int64_t ldo) {
  const int64_t groups = (panels + kGroup - 1) / kGroup;
  std::vector<float> xf(std::min(kRowBlock, m) * k);
  for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
    const int64_t rb = std::min(kRowBlock, m - r0);
    at::parallel_for(0, rb, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const c10::BFloat16* xr = xp + (r0 + r) * ldx;
        float* fr = xf.data() + r * k;
        int64_t i = 0;
        for (; i + 16 <= k; i += 16) _mm512_storeu_ps(fr + i, tokenmill_cpu::load16(xr + i));
        for (; i < k; ++i) fr[i] = static_cast<float>(xr[i]);
      }
    });
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> b(kGroup * std::min(kKc, k) * kPanel), acc(kRowBlock * kGroup * kPanel);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t p = g * kGroup, np = std::min(kGroup, panels - p);
        const int64_t cols = std::min(kPanel, n - (p + np - 1) * kPanel);  // of the group's last panel
        const float* pb = bias != nullptr ? bias + p * kPanel : nullptr;
        const TileFn<TOut> tile = tile_for<TOut>(np);
        for (int64_t k0 = 0; k0 < k; k0 += kKc) {
          const int64_t kc = std::min(kKc, k - k0);
          for (int64_t q = 0; q < np; ++q) src.rebuild(p + q, k0, kc, b.data() + q * kc * kPanel);
          const bool first = k0 == 0, last = k0 + kc == k;
          // The next work item: this group's next K-slice, or the next group's first.
          const bool more = !last || g + 1 < end;
          const int64_t pn = last ? p + kGroup : p, kn = last ? 0 : k0 + kc;
          const int64_t npn = std::min(kGroup, panels - pn), kcn = std::min(kKc, k - kn);
          const int64_t tiles = (rb + kTileRows - 1) / kTileRows;
          for (int64_t r = 0; r < rb; r += kTileRows) {
            if (more) prefetch_part(src, pn, npn, kn, kcn, r / kTileRows, tiles);
            tile(std::min(kTileRows, rb - r), xf.data() + r * k + k0, k, b.data(), kc,
                 acc.data() + r * np * kPanel, first, last, out + (r0 + r) * ldo + p * kPanel, ldo, cols, pb);
          }
        }
      }
    });
  }
}

template <typename Src>
void run_gemm(const Src& src, at::Tensor& out, const at::Tensor& x, int64_t panels, const float* bias) {
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  if (out.scalar_type() == at::kFloat)
    gemm(src, x.data_ptr<c10::BFloat16>(), x.stride(0), m, k, panels, n, bias, out.data_ptr<float>(), out.stride(0));
  else
    gemm(src, x.data_ptr<c10::BFloat16>(), x.stride(0), m, k, panels, n, bias, out.data_ptr<c10::BFloat16>(),
         out.stride(0));
}

// Seconds for `rounds` rounds of 24 independent vdpbf16ps (dot) or fp32 FMAs, the accumulators held in
// registers (summed at the end, so none is dead).
#if defined(__AVX512BF16__)
__attribute__((noinline)) double time_rounds(bool dot, int rounds, float* sink) {
  __m512 acc[24];
  for (int i = 0; i < 24; ++i) acc[i] = _mm512_setzero_ps();
  __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3f803f80));
  __m512 x = _mm512_set1_ps(1.0f), y = _mm512_set1_ps(1e-9f);
  const auto t0 = std::chrono::steady_clock::now();
  if (dot) {
    for (int n = 0; n < rounds; ++n) {
#pragma GCC unroll 24
      for (int i = 0; i < 24; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, a);
      __asm__ volatile("" : "+v"(a));
    }
  } else {
    for (int n = 0; n < rounds; ++n) {
#pragma GCC unroll 24
      for (int i = 0; i < 24; ++i) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
      __asm__ volatile("" : "+v"(x));
    }
  }
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float s = 0.0f;
  for (int i = 0; i < 24; ++i) s += _mm512_reduce_add_ps(acc[i]);
  *sink = s;
  return t;
}
#endif

// GFLOP/s of one core on 24 independent accumulators: vdpbf16ps (64 FLOP each) and fp32 FMAs (32 each),
// the best of 5 runs of 20,000 rounds each (about 0.5 ms in all).
std::vector<double> measure_rates() {
  std::vector<double> rates(2, 0.0);
#if defined(__AVX512BF16__)
  constexpr int kRounds = 20000;
  float sink = 0.0f;
  for (int rep = 0; rep < 5; ++rep) {
    rates[0] = std::max(rates[0], kRounds * 24.0 * 64 / time_rounds(true, kRounds, &sink) / 1e9);
    rates[1] = std::max(rates[1], kRounds * 24.0 * 32 / time_rounds(false, kRounds, &sink) / 1e9);
  }
#endif
  return rates;
}
#endif

bool gemm_bf16_supported() {
#if defined(TOKENMILL_GEMM_BF16)
  return true;
#else
  return false;
#endif
}

// [vdpbf16ps GFLOP/s, fp32 FMA GFLOP/s] of one core (zeros where the build has no AVX-512 BF16).
std::vector<double> bf16_dot_fma_gflops() {
#if defined(TOKENMILL_GEMM_BF16)
  return measure_rates();
#else
  return {0.0, 0.0};
#endif
}

void check_x(const char* op, const at::Tensor& x) {
  TORCH_CHECK(gemm_bf16_supported(), op, ": this build has no AVX-512 path");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1, op,
              ": x must be 2-D bfloat16 with contiguous rows");
}

// out [M, N] (bf16, or fp32: logits) = x [M, K] (bf16) @ W^T (+ bias, fp32), W as pack_bf16_weight made it.
void linear_dense_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias) {
  check_x("linear_dense_gemm", x);
  const int64_t k = x.size(1);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 &&
                  packed.size(2) == 2 * kPanel && packed.is_contiguous() && packed.size(1) * 2 == k,
              "linear_dense_gemm: the weight must be pack_bf16_weight's bfloat16 [panels, K / 2 = ", k / 2, ", 32], got ",
              packed.scalar_type(), " ", packed.sizes());
  const int64_t panels = packed.size(0);
  const float* bp =
      tokenmill_cpu::check_linear_args("linear_dense_gemm", out, x, panels, "the packed weight", bias, true, true);
#if defined(TOKENMILL_GEMM_BF16)
  run_gemm(DenseSource{packed.data_ptr<c10::BFloat16>(), k * kPanel}, out, x, panels, bp);
#else
  (void)bp;
#endif
}

// The same on integer codes (cpu_linear.cpp's layout), for bf16 x: the fp32 weights fma(code, scale, min).
void linear_codes_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  check_x("linear_codes_gemm", x);
  const int64_t k = x.size(1);
  tokenmill_cpu::check_codes("linear_codes_gemm", codes, scales, mins, k, true, true);
  const int64_t panels = codes.size(0);
  const float* bp = tokenmill_cpu::check_linear_args("linear_codes_gemm", out, x, panels, "the codes", bias, true, true);
#if defined(TOKENMILL_GEMM_BF16)
  const bool q4 = codes.scalar_type() == at::kByte;
  const int8_t* cp = static_cast<const int8_t*>(codes.data_ptr());
  const int64_t kb = q4 ? k / 2 * kPanel : k * kPanel, nb = k / kCodeBlock;
  tokenmill_cpu::dispatch_scales(scales, mins, [&](const auto* sp, const auto* mp) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(sp)>>;
    if (q4)
      run_gemm(CodesSource<true, S>{cp, kb, sp, mp, nb}, out, x, panels, bp);
    else
      run_gemm(CodesSource<false, S>{cp, kb, sp, mp, nb}, out, x, panels, bp);
  });
#else
  (void)bp;
#endif
}

}  // namespace

// The ops as plain calls for cpu_decoder.cpp (cpu_ops.h).
namespace tokenmill_cpu {
void linear_dense_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias) {
  ::linear_dense_gemm(out, x, packed, bias);
}
void linear_codes_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  ::linear_codes_gemm(out, x, codes, scales, mins, bias);
}
}  // namespace tokenmill_cpu

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("gemm_bf16_supported() -> bool", &gemm_bf16_supported);
  m.def("bf16_dot_fma_gflops() -> float[]", &bf16_dot_fma_gflops);
  m.def("linear_dense_gemm(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
  m.impl("linear_dense_gemm", c10::DispatchKey::CPU, &linear_dense_gemm);
  m.def("linear_codes_gemm(Tensor(a!) out, Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? bias) -> ()");
  m.impl("linear_codes_gemm", c10::DispatchKey::CPU, &linear_codes_gemm);
}
